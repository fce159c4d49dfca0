"""mypy --strict and ruff are part of the test suite, so the README's one command runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["model", "impl", "specs", "tests", "bench"]
SCRIPTS = ["bench", "tests/kit/targets"]
"""Folders of scripts that import their neighbours by bare name (pyproject's mypy_path)."""


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_mypy_strict_is_clean_on_the_packages_the_tests_and_bench(tmp_path: Path) -> None:
    """One mypy run. It takes packages or files, not both, so the scripts are named as
    modules; their folder is left out of ``-p tests``, where they would get a second name."""
    scripts = sorted(p.stem for folder in SCRIPTS for p in (ROOT / folder).glob("*.py"))
    result = run(
        "mypy",
        "--strict",
        # A cold cache each time: with a warm one, mypy (1.x) reports `from kvpool import
        # model` as an untyped installed package (kvpool is a namespace package whose
        # subpackages carry py.typed), though the cold run that wrote the cache passed.
        "--cache-dir",
        str(tmp_path / "mypy-cache"),
        "--exclude",
        "^tests/kit/targets/",
        *("-p", "kvpool.model", "-p", "kvpool.impl", "-p", "kvpool.specs", "-p", "tests"),
        *(arg for name in scripts for arg in ("-m", name)),
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_is_clean_on_the_packages_the_tests_and_bench(command: list[str]) -> None:
    result = run("ruff", *command, *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr
