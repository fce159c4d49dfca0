"""The JSON codec and the protocol schema: values round-trip, sessions validate."""

import json
import subprocess
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kvpool.model import PoolConfig
from kvpool.specs import protocol
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.vectors import load, load_schema, validators
from tests.kit.helpers import ROOT, node_target

CORPUS = ROOT / "specs" / "vectors" / "data"


@pytest.fixture(scope="module")
def corpus() -> list[Any]:
    return load(CORPUS)


@pytest.fixture(scope="module")
def message_validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema("protocol-v1.json"))


def test_the_schemas_are_valid_json_schemas() -> None:
    for name in ("protocol-v1.json", "vectors-v1.json"):
        Draft202012Validator.check_schema(load_schema(name))
    _, manifest = validators()
    assert manifest.is_valid(json.loads((CORPUS / "manifest.json").read_text()))


def test_every_state_and_event_round_trips(corpus: list[Any]) -> None:
    for vector in corpus:
        config = protocol.decode_config(vector.data["config"])
        assert protocol.encode_config(config) == vector.data["config"]
        for step in vector.data["steps"]:
            state = protocol.decode_state(step["state"], config)
            assert protocol.encode_state(state) == step["state"]
            if step["op"] == "take_events" and "ok" in step["expect"]:
                events = [protocol.decode_event(e) for e in step["expect"]["ok"]]
                assert [protocol.encode_event(e) for e in events] == step["expect"]["ok"]


def test_hashes_are_lowercase_hex() -> None:
    assert protocol.encode_hash(b"\x0a\xff") == "0aff"
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_hash("0AFF")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_hash("abc")


def _session(corpus: list[Any], limit: int = 12) -> list[dict[str, Any]]:
    """Requests replaying the first vectors, as the kit would send them."""
    requests: list[dict[str, Any]] = [{"id": 0, "op": "hello", "args": {"protocol": 1}}]
    for vector in corpus[:limit]:
        requests.append({"id": len(requests), "op": "new_pool", "args": vector.data["config"]})
        for step in vector.data["steps"]:
            requests.append({"id": len(requests), "op": step["op"], "args": step["args"]})
            requests.append({"id": len(requests), "op": "snapshot", "args": {}})
    return requests


def test_a_python_server_session_validates_against_the_schema(
    corpus: list[Any], message_validator: Draft202012Validator
) -> None:
    server = protocol.Server(ModelTarget)
    for request in _session(corpus):
        message_validator.validate(request)
        reply = server.handle(request)
        message_validator.validate(reply)
        assert reply["id"] == request["id"]


def test_the_node_pool_answers_match_the_python_server_and_the_schema(
    corpus: list[Any], message_validator: Draft202012Validator
) -> None:
    node, script = node_target().removeprefix("cmd:").split(" ", 1)
    requests = _session(corpus, limit=40)
    stdin = "".join(json.dumps(r) + "\n" for r in requests)
    done = subprocess.run(
        [node, script], input=stdin, capture_output=True, text=True, timeout=60, check=True
    )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    server = protocol.Server(ModelTarget)
    assert len(replies) == len(requests)
    for request, reply in zip(requests, replies, strict=True):
        message_validator.validate(reply)
        expected = server.handle(request)
        if request["op"] == "hello":
            continue
        expected.pop("message", None)
        reply.pop("message", None)
        if request["op"] == "get_usage":
            assert reply["ok"] == pytest.approx(expected["ok"])
        else:
            assert reply == expected, request


def test_the_server_reports_requests_it_cannot_read() -> None:
    server = protocol.Server(ModelTarget)
    assert server.handle({"id": 1, "op": "touch", "args": {"block_ids": [1]}})["error"] == (
        "ProtocolError"
    )
    server.handle({"id": 2, "op": "new_pool", "args": protocol.encode_config(PoolConfig(3))})
    reply = server.handle({"id": 3, "op": "touch", "args": {"block_ids": ["1"]}})
    assert reply == {
        "id": 3,
        "error": "ProtocolError",
        "message": "block_ids must be an integer, got '1'",
    }
    assert server.handle({"id": 4, "op": "touch", "args": {"block_ids": [7]}})["error"] == (
        "UnknownBlock"
    )
