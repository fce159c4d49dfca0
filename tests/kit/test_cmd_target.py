"""cmd: targets: the Node.js reference pool conforms; misbehaving programs get clear reports."""

import sys
from pathlib import Path

import pytest

from kvpool.model import PoolConfig
from kvpool.specs.conformance import run_conformance
from kvpool.specs.target import TargetError
from kvpool.specs.targets.cmd.pool import CmdTargetFactory
from kvpool.specs.targets.registry import TargetSpecError, resolve_target
from tests.kit.helpers import assert_no_traceback, node_target, python_target, run_kvpool


def test_node_pool_conforms_at_level_1_with_the_ci_profile() -> None:
    result = run_kvpool("check", "--target", node_target(), "--hypothesis-profile", "ci")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "conforms" in result.stdout


def test_node_pool_conforms_at_level_2_in_every_profile() -> None:
    profiles = ["hashless-first", "append", "hashless-first-append-uncached"]
    result = run_kvpool(
        "check",
        "--target",
        node_target(),
        "--level",
        "2",
        *(arg for p in profiles for arg in ("--profile", p)),
        "--hypothesis-profile",
        "ci",
        "--examples",
        "60",
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_python_target_served_over_the_protocol_conforms() -> None:
    factory = resolve_target(f"cmd:{sys.executable} -m kvpool.specs.protocol impl")
    try:
        report = run_conformance(factory, level=2, max_examples=25, target_name="served impl")
    finally:
        factory.close()  # type: ignore[attr-defined]
    assert report.conforms, report.failure


HANG_TIMEOUT = 8
"""Seconds the kit waits for the hanging target's answer. Only the hang needs a short wait;
every other target gets a long one, so that on a loaded machine (CI has 2 cores) a slow but
good answer before the faulty step is never taken for a hang."""
PATIENT = "120"

MISBEHAVING = {
    "crash": ["the target closed its output", "exit code: 3", "Assertion `block->ref_cnt > 0'"],
    "hang": [f"did not answer within {HANG_TIMEOUT} s", "waiting for a lock that never comes"],
    "garbage": ["not JSON", "DEBUG freeing blocks {oops"],
    "out_of_turn": ["out of turn", "expected id"],
}


@pytest.mark.parametrize("name", sorted(MISBEHAVING))
def test_a_misbehaving_target_is_a_target_error_naming_the_operation(name: str) -> None:
    result = run_kvpool(
        "check",
        "--target",
        python_target(name),
        "--hypothesis-profile",
        "ci",
        env={"KVPOOL_CMD_TIMEOUT": str(HANG_TIMEOUT) if name == "hang" else PATIENT},
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "target error during free_blocks" in output
    for phrase in MISBEHAVING[name]:
        assert phrase in output
    assert "could not be run" in output
    assert_no_traceback(result)


def test_wrong_block_ids_are_a_divergence_with_exit_code_1(tmp_path: Path) -> None:
    result = run_kvpool(
        "check",
        "--target",
        python_target("wrong_ids"),
        "--hypothesis-profile",
        "ci",
        "--examples",
        "30",
        "--steps",
        "8",
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Where they part: step 1 of 1, get_new_blocks" in output
    assert "the model returns [1], the target returned [2]" in output
    assert len(list((tmp_path / "kvpool-regression").glob("test_kvpool_regression_*.py"))) == 1
    assert_no_traceback(result)


def test_a_program_that_cannot_start_is_a_target_error() -> None:
    result = run_kvpool("check", "--target", "cmd:/nonexistent/pool --serve")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "cannot start the target program /nonexistent/pool --serve" in output
    assert_no_traceback(result)


def test_a_target_that_lacks_the_level_or_profile_is_refused_before_running() -> None:
    script = (
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    ok = {'protocol': 1, 'levels': [1], 'profiles': ['append']}\n"
        "    print(json.dumps({'id': r['id'], 'ok': ok}), flush=True)\n"
    )
    factory = CmdTargetFactory([sys.executable, "-c", script])
    with pytest.raises(TargetError, match="does not support level 2"):
        factory.preflight(2, ["append"])
    factory = CmdTargetFactory([sys.executable, "-c", script])
    with pytest.raises(TargetError, match=r"does not implement profile\(s\) \['hashless-first'\]"):
        factory.preflight(1, ["hashless-first"])


def test_a_target_speaking_another_protocol_version_is_refused() -> None:
    script = (
        "import json, sys\n"
        "r = json.loads(sys.stdin.readline())\n"
        "print(json.dumps({'id': r['id'], 'ok': {'protocol': 2}}), flush=True)\n"
    )
    factory = CmdTargetFactory([sys.executable, "-c", script])
    with pytest.raises(TargetError, match="protocol version 2; this kit speaks 1"):
        factory(PoolConfig(4))


def test_an_unknown_error_name_is_a_target_error() -> None:
    script = (
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    if r['op'] == 'hello':\n"
        "        reply = {'id': r['id'], 'ok': {'protocol': 1}}\n"
        "    elif r['op'] == 'new_pool':\n"
        "        reply = {'id': r['id'], 'ok': None}\n"
        "    else:\n"
        "        reply = {'id': r['id'], 'error': 'TypeError', 'message': 'x is undefined'}\n"
        "    print(json.dumps(reply), flush=True)\n"
    )
    target = CmdTargetFactory([sys.executable, "-c", script])(PoolConfig(4))
    with pytest.raises(TargetError) as caught:
        target.get_new_blocks(1)
    message = str(caught.value)
    assert "target error during get_new_blocks" in message
    assert "'TypeError', which is not an exception of kvpool.model.errors" in message
    with pytest.raises(TargetError, match="get_new_blocks"):
        target.touch([1])  # broken from then on, with the first error


def test_cmd_needs_a_program() -> None:
    with pytest.raises(TargetSpecError):
        resolve_target("cmd:")
