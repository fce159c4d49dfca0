"""ruff on what the docs add outside specs/ (the build hook and these tests)."""

import subprocess
import sys

import pytest

from tests.docs.helpers import ROOT

PATHS = ["docs/hooks", "tests/docs"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_is_clean_on_the_docs_hook_and_tests(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
