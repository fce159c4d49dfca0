"""Every documented target kind, at every layer it works at, in every way of failing.

The exit code is a contract: 0 only when programs ran and conformed, 1 when
target and model part, 2 when no verdict could be reached. Each cell runs
``kvpool check`` (in-process, through the command's own entry point) with
one method of the target replaced by a failing one (``misbehaving.py``) and
asserts the exit code, the words of the report, and that no traceback
reaches the user. The engine kinds (``vllm``, ``sglang``, ``dynamo``) fail
inside kvpool's adapter of the engine, as an engine's own failure would.
``cmd:`` targets, which run as programs, have their own
rows in ``test_cmd_target.py`` and ``test_hostile_targets.py``.
"""

import importlib
import os
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from kvpool.specs.cli import app
from tests.kit.misbehaving import FAILURES, HANG_TIMEOUT, PATCH_POINTS, failing, owner

NO_REJECTIONS = {"events"}
"""Layers whose targets have no rejections: a consumer raising one is a target error."""

CELLS = [(kind, layer, failure) for (kind, layer) in PATCH_POINTS for failure in FAILURES]


def _engine_unavailable(kind: str) -> str | None:
    """Why the engine a target kind drives cannot be loaded, or None (no engine, or loaded)."""
    if kind == "vllm":
        try:
            importlib.import_module("vllm.v1.core.block_pool")
        except Exception as error:
            return f"vLLM cannot be imported: {error!r}"
    elif kind == "sglang":
        from kvpool.specs.targets.sglang.loading import unavailable_reason as sglang_missing

        return sglang_missing()
    elif kind == "dynamo":
        from kvpool.specs.targets.dynamo.radix_tree import unavailable_reason as dynamo_missing

        return dynamo_missing()
    return None


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[None]:
    """The engine a kind drives (vLLM, SGLang, Dynamo): skipped without it, a failure
    without it under CI (``KVPOOL_REQUIRE_<ENGINE>=1``)."""
    kind = request.node.callspec.params["kind"]
    reason = _engine_unavailable(kind)
    if reason is not None:
        if os.environ.get(f"KVPOOL_REQUIRE_{kind.upper()}") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_{kind.upper()}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    yield


def check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        app,
        ["check", *args, "--hypothesis-profile", "ci", "--examples", "40", "--steps", "12"],
        env={"COLUMNS": "200", "NO_COLOR": "1"},
    )
    return result.exit_code, result.output


@pytest.mark.parametrize(("kind", "layer", "failure"), CELLS)
def test_every_failure_of_every_target_kind_gets_its_exit_code_and_report(
    kind: str, layer: str, failure: str, engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, class_path, method = PATCH_POINTS[(kind, layer)]
    cls = owner(class_path)
    broken = failing(getattr(cls, method), FAILURES[failure])
    if kind == "model":
        # The kit replays the model itself to explain a failure: only the model as a
        # *target* may fail, so the registry gets a subclass (it looks the class up late).
        module = importlib.import_module(cls.__module__)
        monkeypatch.setattr(module, cls.__name__, type(cls.__name__, (cls,), {method: broken}))
    else:
        monkeypatch.setattr(cls, method, broken)
    # Only the hanging cell gets a short program timeout: elsewhere a program slowed down by
    # a loaded machine (CI has 2 cores) must not pass for a hang.
    timeout = str(HANG_TIMEOUT) if failure == "hangs" else "600"
    code, output = check("--layer", layer, "--target", target, "--program-timeout", timeout)
    expected = FAILURES[failure]
    exit_code = expected.exit_code
    if failure == "rejects-a-valid-call" and layer in NO_REJECTIONS:
        exit_code = 2
    assert code == exit_code, output
    assert expected.phrase in output, output
    assert "Traceback" not in output, output
    # A layer run once per semantics (events) lists each one's verdict; the others may conform.
    overall = "\n".join(line for line in output.splitlines() if "verdict under" not in line)
    assert "conforms" not in overall.replace("conforms to", ""), output


@pytest.mark.parametrize(("kind", "layer"), sorted(PATCH_POINTS))
def test_every_target_kind_conforms_untouched(kind: str, layer: str, engine: None) -> None:
    """The control: without a failure each cell exits 0, saying how many programs ran."""
    target, _, _ = PATCH_POINTS[(kind, layer)]
    code, output = check("--layer", layer, "--target", target)
    assert code == 0, output
    assert "conforms" in output and "programs found no difference" in output, output


@pytest.mark.parametrize("layer", ["pool", "request", "v0", "events", "radix"])
def test_a_factory_that_raises_is_a_target_error(
    layer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, class_path, _ = PATCH_POINTS[("module", layer)]

    def broken(*args: object) -> None:
        raise ImportError("the user's pool needs a library that is missing")

    monkeypatch.setattr(owner(class_path), "__init__", broken)
    code, output = check("--layer", layer, "--target", target)
    assert code == 2, output
    flat = " ".join(output.split())
    assert "the factory could not build a target" in flat and "ImportError" in flat, output
    assert "Traceback" not in output


@pytest.mark.parametrize("layer", ["pool", "request", "v0"])
def test_a_factory_with_the_wrong_signature_is_refused_before_running(layer: str) -> None:
    code, output = check(
        "--layer", layer, "--target", "tests.kit.misbehaving:factory_without_argument"
    )
    assert code == 2, output
    assert "must take one argument" in output, output
    assert "Traceback" not in output


def test_the_v0_layer_names_why_vllm_is_unavailable_when_it_is() -> None:
    from kvpool.specs.targets.vllm.v0 import unavailable_reason

    reason = unavailable_reason()
    code, output = check("--layer", "v0", "--target", "vllm", "--examples", "5")
    if reason is None:
        assert code == 0, output
    else:
        assert code == 2 and "cannot be loaded" in output, output


def test_a_run_of_zero_programs_is_no_verdict() -> None:
    """Nothing generated (a profile that only replays, with nothing to replay) is exit 2."""
    from hypothesis import Phase, settings

    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.pool.model_target import ModelTarget

    settings.register_profile(
        "kvpool-test-replay-only", settings.get_profile("ci"), phases=[Phase.explicit]
    )
    report = run_conformance(ModelTarget, hypothesis_profile="kvpool-test-replay-only")
    assert report.examples_run == 0
    assert report.failure_kind == "nothing-ran" and report.exit_code == 2, report
    assert "no program" in (report.failure or "")
