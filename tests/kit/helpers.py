"""Helpers for the conformance-kit tests: run the kvpool CLI, find node."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = Path(__file__).resolve().parent / "targets"
NODE_POOL = ROOT / "examples" / "node-pool" / "pool.js"
NODE_MANAGER = ROOT / "examples" / "node-manager" / "manager.js"


def kvpool_command() -> list[str]:
    script = Path(sys.executable).with_name("kvpool")
    if script.exists():
        return [str(script)]
    found = shutil.which("kvpool")
    assert found is not None, "the kvpool console script is not installed"
    return [found]


def run_kvpool(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the kvpool CLI with wide, colourless output; the repo root importable."""
    full_env = {
        **os.environ,
        "COLUMNS": "200",
        "NO_COLOR": "1",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    full_env.pop("CI", None)
    return subprocess.run(
        [*kvpool_command(), *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def python_target(name: str) -> str:
    """The cmd: target string for a misbehaving Python target in tests/kit/targets."""
    return f"cmd:{sys.executable} {TARGETS / (name + '.py')}"


def node_target() -> str:
    """The cmd: target string for the Node.js reference pool (skips if node is missing)."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("KVPOOL_REQUIRE_NODE") == "1":
            pytest.fail("KVPOOL_REQUIRE_NODE=1 but node is not on PATH")
        pytest.skip("node is not on PATH: the Node.js reference target is not checked")
    return f"cmd:{node} {NODE_POOL}"


def node() -> str:
    """The node executable (skips if node is missing, fails if it is required)."""
    found = shutil.which("node")
    if found is None:
        if os.environ.get("KVPOOL_REQUIRE_NODE") == "1":
            pytest.fail("KVPOOL_REQUIRE_NODE=1 but node is not on PATH")
        pytest.skip("node is not on PATH: the Node.js reference targets are not checked")
    return found


def node_manager_target() -> str:
    """The cmd: target string for the Node.js reference KV cache manager."""
    return f"cmd:{node()} {NODE_MANAGER}"


def python_manager_target(mode: str) -> str:
    """The cmd: target string for the misbehaving request-layer target in tests/kit/targets."""
    return f"cmd:{sys.executable} {TARGETS / 'misbehaving_manager.py'} {mode}"


def assert_no_traceback(result: subprocess.CompletedProcess[str]) -> None:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
