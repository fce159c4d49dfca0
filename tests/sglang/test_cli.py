"""``kvpool check --layer radix`` against SGLang, end to end: exit codes and programs.

Each run is a fresh ``kvpool`` process, so each imports SGLang (seconds).
"""

import json

import pytest

from tests.kit.helpers import assert_no_traceback, run_kvpool

pytestmark = pytest.mark.usefixtures("require_native_hash")

CI = ("--hypothesis-profile", "ci")


def test_the_installed_sglang_conforms() -> None:
    """The full ``ci`` run of the same target is test_conformance's; here the command line."""
    result = run_kvpool("check", "--target", "sglang", "--examples", "30", *CI, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "conforms" in result.stdout
    assert_no_traceback(result)


def _program(stdout: str) -> list[str]:
    """The calls of the failing program, from the JSON report, after the cache's construction."""
    program = json.loads(stdout)["program"].splitlines()
    assert program[0].startswith("new_radix_cache(")
    # Each call is a numbered step: "step N: op(...) -> result".
    return [line.partition(": ")[2] for line in program[1:] if line.startswith("step ")]


def test_a_reset_without_a_clear_exits_1_with_a_short_program() -> None:
    target = "sglang:tests.sglang.bugs:ResetKeepsQuietRadixCache"
    result = run_kvpool(
        "check", "--layer", "radix", "--target", target, "--format", "json", *CI, timeout=300
    )
    assert result.returncode == 1, result.stdout + result.stderr
    program = _program(result.stdout)
    assert len(program) == 1 and program[0].startswith("take_events()"), program
    assert_no_traceback(result)
