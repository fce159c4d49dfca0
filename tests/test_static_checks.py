"""mypy --strict and ruff are part of the test suite, so the README's one command runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["model", "impl", "specs"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_mypy_strict_is_clean_on_model_impl_and_specs() -> None:
    result = run(
        "mypy", "--strict", "-p", "kvpool.model", "-p", "kvpool.impl", "-p", "kvpool.specs"
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_is_clean_on_model_impl_and_specs(command: list[str]) -> None:
    result = run("ruff", *command, *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr
