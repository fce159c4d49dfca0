"""The request layer's protocol: codec round trips, the schema, the servers agree."""

import json
import subprocess
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from kvpool.model.hashing import LoraAdapter, MultiModalInput
from kvpool.model.request import append_tokens, new_request, preempted, with_computed
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import ProtocolError
from kvpool.specs.protocol.request_server import RequestServer
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.vectors import bundled_corpus, load, load_schema
from tests.kit.helpers import NODE_MANAGER, node


@pytest.fixture(scope="module")
def corpus() -> list[Any]:
    return load(bundled_corpus("request"), layer="request")


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schemas = [load_schema(n) for n in ("protocol-v1.json", "request-protocol-v1.json")]
    registry: Registry[Any] = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s)) for s in schemas]
    )
    return Draft202012Validator(schemas[1], registry=registry)


def test_the_request_schemas_are_valid_json_schemas() -> None:
    for name in ("request-protocol-v1.json", "request-vectors-v1.json"):
        Draft202012Validator.check_schema(load_schema(name))


def test_the_schema_names_every_rejection_of_the_model() -> None:
    names = load_schema("request-protocol-v1.json")["$defs"]["error_name"]["enum"]
    assert set(names) == {*codec.REQUEST_ERROR_NAMES, "ProtocolError"}
    assert {"HashBlockSizeMismatch", "NoNewTokens", "UnknownBlock", "InvalidPromptEmbeds"} <= set(
        names
    )


def test_requests_round_trip_with_every_extra_key() -> None:
    request = new_request(
        "r",
        [300, 70000, 2, 3],
        2,
        lora=LoraAdapter(4, "a", "/a"),
        mm_inputs=[MultiModalInput("img", 1, 2)],
        cache_salt="s",
        prompt_embeds=[b"\x00", b"\x01", b"", b"\xff\xfe"],
    )
    request = preempted(with_computed(append_tokens(request, [5]), 3))
    encoded = codec.encode_request(request)
    assert codec.decode_request(json.loads(json.dumps(encoded))) == request
    assert encoded["prompt_embeds"] == ["00", "01", "", "fffe"]


def test_setups_states_and_results_of_the_corpus_round_trip(corpus: list[Any]) -> None:
    checked = 0
    for vector in corpus:
        if vector.data["kind"] != "manager":
            continue
        setup = codec.decode_setup(vector.data["setup"])
        assert codec.encode_setup(setup) == vector.data["setup"]
        for step in vector.data["steps"]:
            if "state" in step:
                state = codec.decode_manager_state(step["state"], setup)
                assert codec.encode_manager_state(state) == step["state"]
                checked += 1
            if "ok" in step["expect"]:
                codec.check_result(step["op"], step["expect"]["ok"])
    assert checked > 200


def _session(corpus: list[Any], limit: int = 20) -> list[dict[str, Any]]:
    """Requests replaying the first manager vectors, as the kit sends them."""
    requests: list[dict[str, Any]] = [
        {"id": 0, "op": "hello", "args": {"protocol": 1, "layer": "request", "kit": "kvpool"}}
    ]
    vectors = [v for v in corpus if v.data["kind"] == "manager"][:limit]
    for vector in vectors:
        requests.append({"id": len(requests), "op": "new_manager", "args": vector.data["setup"]})
        for step in vector.data["steps"]:
            requests.append({"id": len(requests), "op": step["op"], "args": step["args"]})
            requests.append({"id": len(requests), "op": "snapshot", "args": {}})
    return requests


def test_a_python_server_session_validates_against_the_schema(
    corpus: list[Any], validator: Draft202012Validator
) -> None:
    server = RequestServer(ModelManagerTarget)
    for request in _session(corpus):
        validator.validate(request)
        reply = server.handle(request)
        validator.validate(reply)
        assert reply["id"] == request["id"]


def test_the_node_manager_answers_match_the_python_server_and_the_schema(
    corpus: list[Any], validator: Draft202012Validator
) -> None:
    requests = _session(corpus, limit=60)
    stdin = "".join(json.dumps(r) + "\n" for r in requests)
    done = subprocess.run(
        [node(), str(NODE_MANAGER)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    server = RequestServer(ModelManagerTarget)
    assert len(replies) == len(requests)
    for request, reply in zip(requests, replies, strict=True):
        validator.validate(reply)
        expected = server.handle(request)
        if request["op"] == "hello":
            assert reply["ok"]["hasher"] == "kvpool" and reply["ok"]["layer"] == "request"
            continue
        expected.pop("message", None)
        reply.pop("message", None)
        if request["op"] == "usage":
            assert reply["ok"] == pytest.approx(expected["ok"])
        else:
            assert reply == expected, request


def test_the_server_reports_requests_it_cannot_read() -> None:
    server = RequestServer(ModelManagerTarget)
    before = server.handle({"id": 1, "op": "free", "args": {}})
    assert before["error"] == "ProtocolError" and "before new_manager" in before["message"]
    setup = {
        "num_blocks": 4,
        "specs": [
            {"attention": "full", "block_size": 1, "sliding_window": 0, "attention_chunk_size": 0}
        ],
        "max_model_len": 8,
        "hash_block_size": 1,
        "enable_caching": True,
        "use_eagle": False,
        "log_stats": False,
        "enable_events": False,
        "profile": "hashless-first",
    }
    assert server.handle({"id": 2, "op": "new_manager", "args": setup}) == {"id": 2, "ok": None}
    bad = server.handle({"id": 3, "op": "get_block_ids", "args": {"request_id": 7}})
    assert bad == {
        "id": 3,
        "error": "ProtocolError",
        "message": "request_id must be a string, got 7",
    }
    unknown = server.handle({"id": 4, "op": "evict_blocks", "args": {"block_ids": [9]}})
    assert unknown["error"] == "UnknownBlock"
    assert server.handle({"id": 5, "op": "teleport", "args": {}})["error"] == "ProtocolError"
    hello = server.handle({"id": 6, "op": "hello", "args": {"protocol": 1, "layer": "request"}})
    assert hello["ok"]["hasher"] == "none" and hello["ok"]["snapshot"] is True


@pytest.mark.parametrize(
    ("op", "value"),
    [
        ("allocate_slots", "three blocks"),
        ("allocate_slots", [[1, "2"]]),
        ("get_computed_blocks", {"blocks": None, "num_tokens": 0}),
        ("get_computed_blocks", [[1], 2]),
        ("get_block_ids", None),
        ("free", 0),
        ("usage", True),
        ("num_free_blocks", 1.5),
        ("take_events", [{"type": "Teleported"}]),
        ("make_prefix_cache_stats", {"reset": False}),
        ("block_hashes", ["0A"]),
    ],
)
def test_malformed_results_are_protocol_errors(op: str, value: Any) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_result(op, value)


@pytest.mark.parametrize(
    "state",
    [
        {"pool": {}},
        {"pool": None, "groups": [], "stats": None},
        "a state",
    ],
)
def test_a_malformed_manager_state_is_a_protocol_error(corpus: list[Any], state: Any) -> None:
    vector = next(v for v in corpus if v.data["kind"] == "manager")
    setup = codec.decode_setup(vector.data["setup"])
    with pytest.raises(ProtocolError):
        codec.decode_manager_state(state, setup)


@pytest.mark.parametrize("args", [["--layer", "request", "nonsense"], ["--layer", "kv", "impl"]])
def test_serving_a_bad_target_exits_2_naming_it(args: list[str]) -> None:
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kvpool.specs.protocol", *args],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    named = "'nonsense'" if args[-1] == "nonsense" else "'kv'"
    assert named in done.stderr
