"""cmd: targets at the request layer: the Node.js reference manager conforms at levels 1 and 2,
a planted bug in it is found, and misbehaving programs get the same clear reports as at the
pool layer (the operation named, exit 2, no traceback)."""

import sys
from pathlib import Path
from typing import NoReturn

import pytest

from kvpool.model.single_type import full_attention
from kvpool.specs.errors import TargetError
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.target import ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets import TargetSpecError, resolve
from kvpool.specs.targets.cmd.request import CmdManagerFactory
from tests.kit.helpers import (
    TARGETS,
    assert_no_traceback,
    node,
    node_manager_target,
    python_manager_target,
    run_kvpool,
)


def check(*args: str, **kwargs: object) -> tuple[int, str]:
    result = run_kvpool(
        "check",
        "--layer",
        "request",
        "--hypothesis-profile",
        "ci",
        *args,
        **kwargs,  # type: ignore[arg-type]
    )
    assert_no_traceback(result)
    return result.returncode, result.stdout + result.stderr


def test_the_node_manager_conforms_at_level_1() -> None:
    code, output = check("--target", node_manager_target())
    assert code == 0, output
    assert "conforms" in output


def test_the_node_manager_conforms_at_level_2_in_every_profile() -> None:
    profiles = ["hashless-first", "append", "hashless-first-append-uncached"]
    code, output = check(
        "--target",
        node_manager_target(),
        "--level",
        "2",
        *(arg for p in profiles for arg in ("--profile", p)),
    )
    assert code == 0, output
    assert "conforms" in output


def test_a_bug_planted_in_the_node_manager_is_found(tmp_path: Path) -> None:
    code, output = check(
        "--target", f"cmd:{node()} {TARGETS / 'buggy_manager.js'}", "--no-shrink", cwd=tmp_path
    )
    assert code == 1, output
    assert "Where they part" in output
    assert "free_queue" in output
    saved = list((tmp_path / "kvpool-regression").glob("test_kvpool_regression_*.py"))
    assert len(saved) == 1
    assert "RequestReplay" in saved[0].read_text()


def test_a_python_manager_served_over_the_protocol_conforms() -> None:
    spec = f"cmd:{sys.executable} -m kvpool.specs.protocol --layer request impl"
    descriptor = resolve("request", spec)
    assert isinstance(descriptor.factory, CmdManagerFactory)
    try:
        report = run_request_conformance(
            ManagerTargetSpec(descriptor.factory), level=2, max_examples=25
        )
    finally:
        descriptor.factory.close()
    assert report.conforms, report.failure


HANG_TIMEOUT = 8
"""Seconds the kit waits for the hanging manager. Only the hang needs a short wait; every
other target gets a long one, so that on a loaded machine (CI has 2 cores) a slow but good
answer before the faulty step is never taken for a hang."""

MISBEHAVING = {
    "crash": ["the target closed its output", "exit code: 3", "Assertion `table != NULL'"],
    "hang": [f"did not answer within {HANG_TIMEOUT} s", "waiting for a lock that never comes"],
    "garbage": ["not JSON", "DEBUG freeing request {oops"],
    "out_of_turn": ["out of turn", "expected id"],
    "unknown_error": ["'TypeError', which is not an exception of kvpool.model.errors"],
}


@pytest.mark.parametrize("mode", sorted(MISBEHAVING))
def test_a_misbehaving_manager_is_a_target_error_naming_the_operation(mode: str) -> None:
    timeout = str(HANG_TIMEOUT) if mode == "hang" else "120"
    code, output = check(
        "--target", python_manager_target(mode), env={"KVPOOL_CMD_TIMEOUT": timeout}
    )
    flat = " ".join(output.split())
    assert code == 2, output
    assert "target error during free {" in flat
    for phrase in MISBEHAVING[mode]:
        assert phrase in flat, phrase


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("bad_result", "target error during allocate_slots"),
        ("pool_hello", "it speaks the pool's protocol"),
        ("bad_hello", "levels must be a list of 1 and/or 2"),
        ("rejects_setup", "rejected new_manager with InvalidManagerConfig, but the setup is valid"),
    ],
)
def test_a_manager_violating_the_protocol_exits_2(mode: str, says: str) -> None:
    code, output = check("--target", python_manager_target(mode))
    assert code == 2, output
    assert says in " ".join(output.split())


def test_wrong_block_ids_are_a_divergence_with_a_regression_test(tmp_path: Path) -> None:
    code, output = check("--target", python_manager_target("wrong_ids"), cwd=tmp_path)
    assert code == 1, output
    assert "the model returns [[1]], the target returned [[2]]" in " ".join(output.split())
    assert len(list((tmp_path / "kvpool-regression").glob("kvpool_regression_*.jsonl"))) == 1


def test_a_program_that_cannot_start_is_a_target_error() -> None:
    code, output = check("--target", "cmd:/nonexistent/manager --serve")
    assert code == 2, output
    assert "cannot start the target program /nonexistent/manager --serve" in output


def test_a_manager_that_lacks_the_level_or_profile_is_refused_before_running() -> None:
    script = (
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    ok = {'protocol': 1, 'layer': 'request', 'levels': [1], 'profiles': ['append']}\n"
        "    print(json.dumps({'id': r['id'], 'ok': ok}), flush=True)\n"
    )
    factory = CmdManagerFactory([sys.executable, "-c", script])
    with pytest.raises(TargetError, match="does not support level 2"):
        factory.preflight(2, ["append"])
    factory = CmdManagerFactory([sys.executable, "-c", script])
    with pytest.raises(TargetError, match=r"does not implement profile\(s\) \['hashless-first'\]"):
        factory.preflight(1, ["hashless-first"])
    factory.close()


def test_a_manager_claiming_part_of_the_space_is_checked_on_that_part() -> None:
    script = (
        "import json, sys\n"
        "from kvpool.specs.protocol.request_server import RequestServer\n"
        "from kvpool.specs.request.model_target import ModelManagerTarget\n"
        "server = RequestServer(ModelManagerTarget)\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    reply = server.handle(r)\n"
        "    if r['op'] == 'hello':\n"
        "        reply['ok'].update(layouts=['sliding_window'], events=[False], min_window=3)\n"
        "    if r['op'] == 'new_manager':\n"
        "        s = r['args']\n"
        "        assert [g['attention'] for g in s['specs']] == ['sliding_window'], s\n"
        "        assert not s['enable_events'] and s['specs'][0]['sliding_window'] >= 3, s\n"
        "    print(json.dumps(reply), flush=True)\n"
    )
    factory = CmdManagerFactory([sys.executable, "-c", script])
    try:
        report = run_request_conformance(ManagerTargetSpec(factory), max_examples=30)
    finally:
        factory.close()
    assert report.conforms, report.failure


def test_a_factory_that_raises_is_a_target_error(tmp_path: Path) -> None:
    (tmp_path / "mymanager.py").write_text(
        "def make(setup):\n    raise RuntimeError('this manager needs a GPU')\n"
    )
    code, output = check("--target", "mymanager:make", "--examples", "5", cwd=tmp_path)
    assert code == 2, output
    assert "the factory could not build a target" in " ".join(output.split())
    assert "RuntimeError: this manager needs a GPU" in " ".join(output.split())


def test_a_factory_rejecting_a_valid_setup_is_a_target_error() -> None:
    from kvpool.model.errors import InvalidManagerConfig
    from kvpool.specs.request.record import build

    def refuses(setup: ManagerSetup) -> NoReturn:
        raise InvalidManagerConfig("not today")

    with pytest.raises(TargetError, match="but the model accepts it"):
        build(refuses, ManagerSetup(4, (full_attention(1),), 8, 1))


@pytest.mark.parametrize("spec", ["cmd:", "cmd:   ", "cmd:'unbalanced"])
def test_a_malformed_cmd_string_is_refused(spec: str) -> None:
    with pytest.raises(TargetSpecError):
        resolve("request", spec)
    code, output = check("--target", spec)
    assert code == 2, output
