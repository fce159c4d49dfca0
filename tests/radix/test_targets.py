"""Radix-layer target strings: the model, SGLang's caches, and what is refused (exit 2, a reason).

None of these needs SGLang: a missing or broken one is simulated.
"""

from pathlib import Path

import pytest

from kvpool.specs.radix.model_target import ModelRadixTarget
from kvpool.specs.targets import LAYERS, TargetSpecError, registry, resolve
from tests.kit.helpers import assert_no_traceback, run_kvpool


def test_the_radix_layer_is_registered() -> None:
    assert "radix" in LAYERS
    assert "match_prefix" in registry.OPERATIONS["radix"]
    assert resolve("radix", "model").factory is ModelRadixTarget


@pytest.mark.parametrize("layer", ["pool", "request", "v0"])
@pytest.mark.parametrize("spec", ["sglang", "sglang:rust", "sglang==0.5.23"])
def test_sglang_targets_belong_to_the_radix_layer(layer: str, spec: str) -> None:
    with pytest.raises(TargetSpecError, match="--layer radix"):
        resolve(layer, spec)


@pytest.mark.parametrize("spec", ["impl", "cmd:node pool.js", "vllm", "vllm==0.33.0"])
def test_other_engines_are_refused_at_the_radix_layer(spec: str) -> None:
    with pytest.raises(TargetSpecError, match="radix layer"):
        resolve("radix", spec)


def test_a_missing_sglang_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "sglang_installed_version", lambda: None)
    with pytest.raises(TargetSpecError, match="SGLang is not installed"):
        resolve("radix", "sglang")


def test_another_release_than_the_installed_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "sglang_installed_version", lambda: "0.5.23")
    with pytest.raises(TargetSpecError, match=r"0\.5\.23 is installed here, not 0\.5\.22"):
        resolve("radix", "sglang==0.5.22")


def test_a_malformed_release_is_refused() -> None:
    with pytest.raises(TargetSpecError, match="not an SGLang version"):
        resolve("radix", "sglang==latest")


def _broken_sglang(root: Path, version: str = "0.5.23") -> str:
    """A directory that shadows SGLang with a release whose import fails."""
    package = root / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('this SGLang is broken on purpose')\n")
    info = root / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return str(root)


def test_a_broken_sglang_exits_2_with_the_reason(tmp_path: Path) -> None:
    shadow = _broken_sglang(tmp_path)
    root = str(Path(__file__).resolve().parents[2])
    result = run_kvpool(
        "check", "--layer", "radix", "--target", "sglang", env={"PYTHONPATH": f"{shadow}:{root}"}
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "broken on purpose" in result.stdout + result.stderr
    assert_no_traceback(result)


def test_an_sglang_target_needs_no_layer_option(tmp_path: Path) -> None:
    """``kvpool check --target sglang`` checks the radix layer (here: a broken SGLang, exit 2)."""
    shadow = _broken_sglang(tmp_path)
    root = str(Path(__file__).resolve().parents[2])
    result = run_kvpool("check", "--target", "sglang", env={"PYTHONPATH": f"{shadow}:{root}"})
    assert result.returncode == 2
    assert "broken on purpose" in result.stdout + result.stderr


def test_a_release_that_is_not_installed_exits_2(tmp_path: Path) -> None:
    shadow = _broken_sglang(tmp_path)
    root = str(Path(__file__).resolve().parents[2])
    result = run_kvpool(
        "check",
        "--layer",
        "radix",
        "--target",
        "sglang==0.5.19",
        env={"PYTHONPATH": f"{shadow}:{root}"},
    )
    assert result.returncode == 2
    assert "not 0.5.19" in result.stdout + result.stderr
    assert_no_traceback(result)


def test_the_cli_checks_the_model_under_a_policy() -> None:
    result = run_kvpool(
        "check", "--layer", "radix", "--profile", "slru", "--examples", "10", "--steps", "10"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "slru" in result.stdout and "conforms" in result.stdout


def test_the_cli_refuses_an_unknown_policy() -> None:
    result = run_kvpool("check", "--layer", "radix", "--profile", "tlru")
    assert result.returncode == 2
    assert "eviction policy" in result.stdout + result.stderr
    assert_no_traceback(result)
