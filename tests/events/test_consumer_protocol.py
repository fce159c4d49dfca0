"""The consumer protocol: a Python consumer served over JSON lines, its schema, bad programs."""

import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from kvpool.model import EventSemantics
from kvpool.specs.errors import TargetError
from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.events.target import ConsumerConfig, Query
from kvpool.specs.protocol.codec import ProtocolError
from kvpool.specs.protocol.consumer import ConsumerServer, decode_consumer_config, decode_scores
from kvpool.specs.targets.cmd.consumer import CmdConsumerFactory
from kvpool.specs.vectors import events as event_vectors
from kvpool.specs.vectors.format import load_schema
from tests.kit.helpers import ROOT, assert_no_traceback, run_kvpool

PROGRAM = Path(__file__).resolve().parent / "programs" / "misbehaving_consumer.py"
SERVED = f"cmd:{sys.executable} -m kvpool.specs.protocol --consumer model"


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schemas = [load_schema(n) for n in ("protocol-v1.json", "consumer-v1.json")]
    registry: Registry[Any] = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s)) for s in schemas]
    )
    return Draft202012Validator(schemas[1], registry=registry)


def test_a_served_session_validates_against_the_schema(validator: Draft202012Validator) -> None:
    vectors = event_vectors.load(ROOT / "specs" / "vectors" / "event-data")
    server = ConsumerServer(ReferenceConsumer)
    requests: list[dict[str, Any]] = [
        {"id": 0, "op": "hello", "args": {"protocol": 1, "kit": "kvpool", "layer": "events"}}
    ]
    for vector in vectors[:6]:
        config = {**vector.data["config"], "event_semantics": vector.data["event_semantics"]}
        requests.append({"id": len(requests), "op": "new_consumer", "args": config})
        for step in vector.data["steps"]:
            args = {k: v for k, v in step.items() if k in ("worker", "events", "query")}
            requests.append({"id": len(requests), "op": step["op"], "args": args})
    for request in requests:
        validator.validate(request)
        reply = server.handle(request)
        validator.validate(reply)
        assert "error" not in reply, reply
    assert server.handle(requests[0])["ok"]["remove_worker"] is True


def test_the_server_refuses_what_it_cannot_read() -> None:
    server = ConsumerServer(ReferenceConsumer)
    assert server.handle({"id": 1, "op": "scores", "args": {}})["error"] == "ProtocolError"
    server.handle(
        {"id": 2, "op": "new_consumer", "args": {"num_workers": 1, "block_size": 1,
                                                  "event_semantics": "multiset"}}
    )  # fmt: skip
    for args in ({"worker": 3, "events": []}, {"worker": 0, "events": [{"type": "Nope"}]}):
        reply = server.handle({"id": 3, "op": "apply_events", "args": args})
        assert reply["error"] == "ProtocolError"
    assert server.handle("not a request")["error"] == "ProtocolError"


@pytest.mark.parametrize(
    "args",
    [
        {"num_workers": 0, "block_size": 1, "event_semantics": "multiset"},
        {"num_workers": 1, "block_size": 0, "event_semantics": "multiset"},
        {"num_workers": 1, "block_size": 1, "event_semantics": "set"},
        {"num_workers": True, "block_size": 1, "event_semantics": "multiset"},
    ],
)
def test_bad_consumer_configs_are_protocol_errors(args: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        decode_consumer_config(args)


def test_scores_must_be_one_integer_per_worker() -> None:
    assert decode_scores([2, 0], 2) == {0: 2, 1: 0}
    for bad in ([1], [1, "2"], {"0": 1}, None):
        with pytest.raises(ProtocolError):
            decode_scores(bad, 2)


def test_a_served_consumer_conforms_and_replays_the_vectors() -> None:
    factory = CmdConsumerFactory.from_spec(SERVED)
    try:
        consumer = factory(ConsumerConfig(2, 1, EventSemantics.MULTISET))
        assert consumer.scores(Query((1,), (b"\x01",))) == {0: 0, 1: 0}
        vectors = event_vectors.load(ROOT / "specs" / "vectors" / "event-data")
        result = event_vectors.run_corpus(factory, vectors, target="model")
        assert result.passed == result.run == len(vectors)
    finally:
        factory.close()
    checked = run_kvpool(
        "check", "--layer", "events", "--target", SERVED, "--hypothesis-profile", "ci",
        "--examples", "15",
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


MISBEHAVING = {
    "crash": ["closed its output", "exit code: 4", "panic: nil map entry"],
    "garbage": ["not JSON", "DEBUG scoring"],
    "error": ["a consumer has no rejections", "unknown block"],
    "short": ["scores answered", "entries for"],
    "hang": ["did not answer within 3 s"],
}


@pytest.mark.parametrize("mode", sorted(MISBEHAVING))
def test_a_misbehaving_consumer_program_is_a_target_error(mode: str) -> None:
    result = run_kvpool(
        "check", "--layer", "events", "--target", f"cmd:{sys.executable} {PROGRAM} {mode}",
        "--hypothesis-profile", "ci", "--examples", "20",
        env={"KVPOOL_CMD_TIMEOUT": "3" if mode == "hang" else "20"},
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert_no_traceback(result)
    for phrase in MISBEHAVING[mode]:
        assert phrase in output, output


def test_hello_must_speak_the_consumer_protocol(tmp_path: Path) -> None:
    program = tmp_path / "old.py"
    program.write_text(
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    print(json.dumps({'id': r['id'], 'ok': {'protocol': 2, 'event_semantics': []}}),"
        " flush=True)\n"
    )
    factory = CmdConsumerFactory([sys.executable, str(program)], timeout=20)
    with pytest.raises(TargetError, match="protocol version 2"):
        factory.preflight(1, ["multiset"])
