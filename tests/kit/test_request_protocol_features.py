"""The request protocol's optional features (hello's ``features``, docs/formats.md).

kvpool's impl served over the protocol announces every feature, is asked each one and
conforms; a program announcing none is asked none; a bug planted in one new call diverges
(exit 1); a malformed answer to one, or a malformed announcement, is exit 2 with a clear
message. The divergence runs use the ``mutation`` profile (no shrinking): only the verdict
matters there, and it comes in seconds.
"""

import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import ProtocolError
from kvpool.specs.protocol.request_server import RequestServer
from kvpool.specs.request.check import narrowed
from kvpool.specs.request.target import (
    OPERATIONS_033,
    OPERATIONS_SCHEDULER,
    ManagerSetup,
    ManagerTargetSpec,
)
from kvpool.specs.targets import resolve
from kvpool.specs.targets.cmd.request import CMD_SCOPE, CmdManagerFactory, CmdManagerTarget
from kvpool.specs.targets.impl.request import ImplManagerTarget
from kvpool.specs.vectors import load_schema
from tests.kit.helpers import TARGETS, assert_no_traceback, run_kvpool

SETUP_FIELDS = (
    "max_in_flight_tokens",
    "num_prefill_lookahead",
    "dcp_world_size",
    "pcp_world_size",
    "retention_interval",
    "eagle_groups",
)
"""Setup fields sent only to a program announcing their feature."""

CONNECTOR_FIELDS = ("num_external_computed_tokens", "reserved_blocks", "skip_zeroing_group_ids")
"""``allocate_slots``' fields sent only to a program announcing ``connector_loads``."""


def check(*args: str, cwd: Path) -> tuple[int, str]:
    result = run_kvpool("check", "--layer", "request", *args, cwd=cwd)
    assert_no_traceback(result)
    return result.returncode, " ".join((result.stdout + result.stderr).split())


def featured(mode: str, log: Path) -> str:
    return f"cmd:{sys.executable} {TARGETS / 'featured_manager.py'} {mode} {log}"


def asked(log: Path) -> tuple[Counter[str], Counter[str]]:
    """The operations a program was sent, and how often each feature's setup or argument."""
    ops: Counter[str] = Counter()
    fields: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        request = json.loads(line)
        ops[request["op"]] += 1
        args = request["args"]
        if request["op"] == "new_manager":
            fields.update(f for f in (*SETUP_FIELDS, "fine_grained_hits") if f in args)
            if args["use_eagle"] and len(args["specs"]) > 1:
                fields["eagle_on_a_hybrid"] += 1
        if request["op"] == "allocate_slots" and args.get("full_sequence_must_fit"):
            fields["full_sequence_must_fit"] += 1
        if request["op"] == "allocate_slots":
            fields.update(f for f in CONNECTOR_FIELDS if f in args)
        if "shared_prefix_boundary" in args.get("request", {}):
            fields["shared_prefix_boundary"] += 1
    return ops, fields


# --------------------------------------------------------------------------
# Announcing
# --------------------------------------------------------------------------


def test_the_served_impl_announces_every_feature_and_only_what_it_is_told() -> None:
    hello = {"id": 0, "op": "hello", "args": {"protocol": 1, "layer": "request"}}
    found = RequestServer(ImplManagerTarget).handle(hello)["ok"]
    assert found["features"] == list(codec.FEATURES)
    assert found["fine_grained"] is True  # the boolean earlier kits read
    told = RequestServer(ImplManagerTarget, features=("scheduler_calls",)).handle(hello)["ok"]
    assert told["features"] == ["scheduler_calls"] and "fine_grained" not in told
    none = RequestServer(ImplManagerTarget, features=()).handle(hello)["ok"]
    assert "features" not in none and "fine_grained" not in none
    with pytest.raises(ValueError, match="unknown feature"):
        RequestServer(ImplManagerTarget, features=("teleport",))


def _factory_saying(hello: dict[str, Any]) -> CmdManagerFactory:
    factory = CmdManagerFactory(["never-started"])
    factory.session.hello_answer = lambda: {"protocol": 1, "layer": "request", **hello}  # type: ignore[method-assign]
    return factory


def test_a_programs_scope_is_built_from_the_features_it_announces() -> None:
    scope = _factory_saying({"features": ["scheduler_calls", "context_parallel", "later"]})
    claimed = scope.declared_scope()
    assert claimed["scheduler_calls"] is True and None in claimed["in_flight"]
    assert (2, 2) in claimed["context_parallel"]
    assert claimed["fine_grained"] == (False,) and claimed["prefill_lookaheads"] == (0,)
    assert claimed["eagle_hybrids"] is False
    # a name this kit does not know is ignored: the program may be newer than the kit
    assert scope.features == {"scheduler_calls", "context_parallel"}
    target = narrowed(ManagerTargetSpec(scope, **CMD_SCOPE), claimed)
    assert target.scheduler_calls and target.in_flight == (None, 1, 3)
    assert set(target.prefill_lookaheads) == {0} and target.fine_grained == (False,)
    # last round's three: off unless announced
    assert set(target.retentions) == {None}
    assert not target.connector_loads and not target.eagle_flags


def test_a_program_announcing_last_rounds_features_is_drawn_them() -> None:
    announced = ["fine_grained", "scheduler_calls", "sparse_retention", "connector_loads"]
    announced.append("eagle_flags")
    scope = _factory_saying({"features": announced})
    target = narrowed(ManagerTargetSpec(scope, **CMD_SCOPE), scope.declared_scope())
    assert target.retentions == (None, None, 0, 1, 2)
    assert target.connector_loads and target.eagle_flags and target.scheduler_calls
    # a target of such a program forwards a KV connector's loads
    manager = CmdManagerTarget(scope, ManagerSetup(4, (full_attention(1),), 8, 1), 0)
    sent: list[tuple[str, dict[str, Any]]] = []

    def answer(op: str, args: dict[str, Any]) -> Any:
        sent.append((op, args))
        return [[1]]

    scope.request = answer  # type: ignore[method-assign]
    request = new_request("a", [1, 2, 3], 1)
    assert manager.allocate_slots(request, 1, 0, None, 0, False, False, 2, 1, (0,)) == ((1,),)
    assert {k: sent[0][1][k] for k in CONNECTOR_FIELDS} == {
        "num_external_computed_tokens": 2,
        "reserved_blocks": 1,
        "skip_zeroing_group_ids": [0],
    }


def test_a_program_not_announcing_connector_loads_is_never_sent_them() -> None:
    scope = _factory_saying({"features": ["scheduler_calls"]})
    manager = CmdManagerTarget(scope, ManagerSetup(4, (full_attention(1),), 8, 1), 0)
    with pytest.raises(RuntimeError, match="did not announce"):
        manager.allocate_slots(new_request("a", [1, 2, 3], 1), 1, 0, None, 0, False, False, 2)


def test_a_feature_announced_without_the_one_it_needs_is_refused() -> None:
    from kvpool.specs.targets.cmd.request import REQUEST_DIALECT
    from kvpool.specs.targets.cmd.session import SessionFailure

    hello = {"protocol": 1, "layer": "request", "features": ["connector_loads"]}
    with pytest.raises(SessionFailure, match="connector_loads needs scheduler_calls"):
        REQUEST_DIALECT.check_hello(hello)
    alone = {"protocol": 1, "layer": "request", "features": ["sparse_retention"]}
    with pytest.raises(SessionFailure, match="sparse_retention needs fine_grained"):
        REQUEST_DIALECT.check_hello(alone)
    # fine_grained announced the older way counts
    REQUEST_DIALECT.check_hello({**alone, "fine_grained": True})


def test_a_program_announcing_a_feature_draws_what_kvpools_targets_draw() -> None:
    from kvpool.specs.targets.cmd.request import FEATURE_SCOPES
    from kvpool.specs.targets.registry import PREFILL_LOOKAHEADS, RETENTIONS

    assert FEATURE_SCOPES["prefill_lookahead"][0]["prefill_lookaheads"] == PREFILL_LOOKAHEADS
    assert FEATURE_SCOPES["sparse_retention"][0]["retentions"] == RETENTIONS
    assert set(FEATURE_SCOPES) == set(codec.FEATURES)


def test_a_program_written_before_features_keeps_its_scope() -> None:
    earlier = _factory_saying({"fine_grained": True})
    target = narrowed(ManagerTargetSpec(earlier, **CMD_SCOPE), earlier.declared_scope())
    assert target.fine_grained == (False, True)
    assert not target.scheduler_calls and target.in_flight == (None,)
    assert target.context_parallel == ((1, 1),) and not target.eagle_hybrids
    # its targets have vLLM 0.33's further calls, not the rest of the scheduler's
    manager = CmdManagerTarget(earlier, ManagerSetup(4, (full_attention(1),), 8, 1), 0)
    assert callable(getattr(manager, "take_kv_cache_block_copies", None))
    assert getattr(manager, "pop_blocks_for_free", None) is None


@pytest.mark.parametrize(
    "features",
    ["all", ["x" * 65], [1], ["f"] * 65],
    ids=["a string", "a long name", "a number", "too many"],
)
def test_a_malformed_announcement_is_refused_by_name(features: Any) -> None:
    from kvpool.specs.targets.cmd.request import REQUEST_DIALECT
    from kvpool.specs.targets.cmd.session import SessionFailure

    hello = {"protocol": 1, "layer": "request", "features": features}
    with pytest.raises(SessionFailure, match="hello: features must be a list"):
        REQUEST_DIALECT.check_hello(hello)


# --------------------------------------------------------------------------
# Values of the new calls
# --------------------------------------------------------------------------


def test_the_new_calls_results_round_trip() -> None:
    values = {
        "pop_blocks_for_free": ([3, 1], (3, 1)),
        "get_block_ids_for_computed_tokens": ([[1, 2], [0]], ((1, 2), (0,))),
        "get_computed_blocks_for_connector": (
            {"blocks": [[1]], "num_tokens": 2, "boundary": 0, "hit_diverged": False},
            (((1,),), 2, 0, False),
        ),
        "take_boundary_state_offloads": ({"r0": [[1, 4, 2]]}, {"r0": ((1, 4, 2),)}),
        "finalize_partial_tail_offloads": ([[1, 4, 2]], ((1, 4, 2),)),
        "remove_skipped_blocks": (None, None),
        "record_blocks_for_zeroing": (None, None),
    }
    assert set(values) == set(OPERATIONS_SCHEDULER)
    for op, (value, python) in values.items():
        assert codec.decode_result(op, value) == python, op
        assert codec.encode_result(op, python) == value, op


def test_a_requests_shared_prefix_boundary_travels_only_when_noted() -> None:
    request = new_request("a", [1, 2, 3, 4], 2)
    assert "shared_prefix_boundary" not in codec.encode_request(request)  # bytes as before
    noted = replace(request, shared_prefix_boundary=2)
    encoded = codec.encode_request(noted)
    assert encoded["shared_prefix_boundary"] == 2
    assert codec.decode_request(encoded) == noted
    with pytest.raises(ProtocolError, match="shared_prefix_boundary must be an integer"):
        codec.decode_request({**encoded, "shared_prefix_boundary": "2"})


def test_last_rounds_setup_fields_round_trip() -> None:
    setup = ManagerSetup(
        4, (full_attention(1), sliding_window(1, 2)), 8, 1, retention_interval=0, eagle_groups=(1,)
    )
    encoded = codec.encode_setup(setup)
    assert encoded["retention_interval"] == 0 and encoded["eagle_groups"] == [1]
    assert codec.decode_setup(json.loads(json.dumps(encoded))) == setup
    plain = codec.encode_setup(ManagerSetup(4, (full_attention(1),), 8, 1))
    assert "retention_interval" not in plain and "eagle_groups" not in plain


@pytest.mark.parametrize(
    ("op", "value"),
    [
        ("pop_blocks_for_free", [1, "2"]),
        ("get_block_ids_for_computed_tokens", None),
        ("get_computed_blocks_for_connector", {"blocks": [[1]], "num_tokens": 2, "boundary": 0}),
        ("get_computed_blocks_for_connector", {"blocks": None, "num_tokens": 0}),
        ("take_boundary_state_offloads", {"r0": [[1, 4]]}),
        ("take_boundary_state_offloads", [[1, 4, 2]]),
        ("finalize_partial_tail_offloads", [[1, 4, 2, 7]]),
        ("remove_skipped_blocks", 0),
        ("record_blocks_for_zeroing", []),
    ],
)
def test_malformed_results_of_the_new_calls_are_protocol_errors(op: str, value: Any) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_result(op, value)


def test_a_session_with_every_new_call_validates_against_the_schema() -> None:
    schemas = [load_schema(n) for n in ("protocol-v1.json", "request-protocol-v1.json")]
    registry: Registry[Any] = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s)) for s in schemas]
    )
    validator = Draft202012Validator(schemas[1], registry=registry)
    setup = ManagerSetup(
        8,
        (full_attention(2),),
        16,
        2,
        fine_grained_hits=True,
        max_in_flight_tokens=6,
        num_prefill_lookahead=1,
        use_eagle=True,
        dcp_world_size=1,
        pcp_world_size=2,
        retention_interval=0,
        eagle_groups=(0,),
    )
    request = replace(new_request("a", [1, 2, 3, 4, 5], 2), shared_prefix_boundary=2)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("hello", {"protocol": 1, "layer": "request", "features": list(codec.FEATURES)}),
        ("new_manager", codec.encode_setup(setup)),
        ("get_computed_blocks_for_connector", codec.encode_args("get_computed_blocks", request)),
        (
            "allocate_slots",
            # with a KV connector's loads: two external tokens, a reserved block
            codec.encode_args("allocate_slots", request, 3, 0, None, 0, False, True, 2, 1, (0,)),
        ),
    ]
    done = with_computed(request, 4)
    for op in (*OPERATIONS_033, *OPERATIONS_SCHEDULER):
        if op in ("get_computed_blocks_for_connector",):
            continue
        args: tuple[Any, ...] = ()
        if op in ("remove_skipped_blocks", "get_block_ids_for_computed_tokens"):
            args = ("a", 4)
        elif op == "record_blocks_for_zeroing":
            args = ("a", 0)
        elif op == "free_blocks":
            args = ([],)
        elif op == "truncate_computed_blocks":
            args = (((1, 2),), 4)
        elif op in (
            "get_computed_blocks_with_boundary",
            "estimate_cached_tokens",
            "finalize_partial_tail_offloads",
        ):
            args = (done,)
        elif op == "pop_blocks_for_free":
            continue  # last: it takes the request's blocks
        calls.append((op, codec.encode_args(op, *args)))
    calls.append(("pop_blocks_for_free", codec.encode_args("pop_blocks_for_free", done)))
    assert {op for op, _ in calls} >= {*OPERATIONS_033, *OPERATIONS_SCHEDULER}
    assert {"retention_interval", "eagle_groups"} <= set(calls[1][1])
    assert set(CONNECTOR_FIELDS) <= set(calls[3][1])
    assert calls[2][1]["request"]["shared_prefix_boundary"] == 2
    server = RequestServer(ImplManagerTarget)
    for i, (op, sent) in enumerate(calls):
        message = {"id": i, "op": op, "args": json.loads(json.dumps(sent))}
        validator.validate(message)
        reply = server.handle(message)
        assert "ok" in reply, (op, reply)
        validator.validate(reply)
        # each result has its shape in the schema, hello's with its features
        result = {"$ref": f"{schemas[1]['$id']}#/$defs/result_{op}"}
        Draft202012Validator(result, registry=registry).validate(reply["ok"])


# --------------------------------------------------------------------------
# cmd: targets
# --------------------------------------------------------------------------


def test_the_impl_served_over_the_protocol_is_asked_every_feature_and_conforms(
    tmp_path: Path,
) -> None:
    log = tmp_path / "asked.jsonl"
    code, output = check(
        "--target",
        featured("good", log),
        "--hypothesis-profile",
        "ci",
        "--examples",
        "100",  # 60 draw no shared-prefix boundary under sparse retention
        cwd=tmp_path,
    )
    assert code == 0, output
    assert "conforms" in output
    ops, fields = asked(log)
    assert set(OPERATIONS_SCHEDULER) | set(OPERATIONS_033) <= set(ops)
    assert set(SETUP_FIELDS) | {"fine_grained_hits", "eagle_on_a_hybrid"} <= set(fields)
    assert fields["full_sequence_must_fit"] > 0
    # last round's three: sparse retention (with its boundaries), a connector's loads, flags
    assert set(CONNECTOR_FIELDS) | {"shared_prefix_boundary"} <= set(fields)


def test_kvpools_request_server_conforms_at_level_2_with_every_feature(tmp_path: Path) -> None:
    served = f"cmd:{sys.executable} -m kvpool.specs.protocol --layer request impl"
    descriptor = resolve("request", served)
    assert isinstance(descriptor.factory, CmdManagerFactory)
    try:
        assert descriptor.factory.features == set(codec.FEATURES)
    finally:
        descriptor.factory.close()
    code, output = check(
        "--target",
        served,
        "--level",
        "2",
        "--hypothesis-profile",
        "ci",
        "--examples",
        "30",
        cwd=tmp_path,
    )
    assert code == 0, output
    assert "conforms" in output


def test_a_program_announcing_no_feature_is_asked_none(tmp_path: Path) -> None:
    log = tmp_path / "asked.jsonl"
    code, output = check(
        "--target",
        featured("old", log),
        "--hypothesis-profile",
        "ci",
        "--examples",
        "30",
        cwd=tmp_path,
    )
    assert code == 0, output
    ops, fields = asked(log)
    assert not set(ops) & {*OPERATIONS_033, *OPERATIONS_SCHEDULER}
    assert not fields
    assert ops["allocate_slots"] > 0


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        (
            "connector_bug",
            # the model's hit, the target's none
            [
                "get_computed_blocks_for_connector",
                "the target returned {'blocks': [[]",
                "'num_tokens': 0",
            ],
        ),
        ("ignores_whole", ["full_sequence_must_fit=True", "the model returns None"]),
        ("ignores_retention", ["the target's state differs", "'retention_interval': "]),
        ("ignores_reserved", ["reserved_blocks=", "the model returns None, the target returned"]),
        ("ignores_eagle_flags", ["the target's state differs", "'eagle_groups': "]),
    ],
)
def test_a_bug_planted_in_a_new_call_diverges(mode: str, says: list[str], tmp_path: Path) -> None:
    code, output = check(
        "--target",
        featured(mode, tmp_path / "asked.jsonl"),
        "--hypothesis-profile",
        "mutation",
        cwd=tmp_path,
    )
    assert code == 1, output
    assert "diverges" in output
    for phrase in says:
        assert phrase in output, phrase


def test_a_malformed_answer_to_a_new_call_is_a_target_error(tmp_path: Path) -> None:
    target = featured("bad_connector_answer", tmp_path / "asked.jsonl")
    code, output = check("--target", target, "--hypothesis-profile", "ci", cwd=tmp_path)
    assert code == 2, output
    assert "target error during get_computed_blocks_for_connector" in output
    assert "malformed result: hit_diverged must be true or false, got None" in output


def test_a_malformed_answer_to_a_connector_load_is_a_target_error(tmp_path: Path) -> None:
    target = featured("bad_loads_answer", tmp_path / "asked.jsonl")
    code, output = check("--target", target, "--hypothesis-profile", "mutation", cwd=tmp_path)
    assert code == 2, output
    assert "target error during allocate_slots" in output
    assert "malformed result: blocks must be an integer, got '1'" in output


def test_connector_loads_without_the_scheduler_calls_is_exit_2(tmp_path: Path) -> None:
    target = featured("connector_alone", tmp_path / "asked.jsonl")
    code, output = check("--target", target, "--hypothesis-profile", "ci", cwd=tmp_path)
    assert code == 2, output
    assert "hello: feature connector_loads needs scheduler_calls" in output
    assert "programs run │ 0" in output


def test_a_malformed_announcement_is_exit_2_before_any_program(tmp_path: Path) -> None:
    target = featured("bad_features", tmp_path / "asked.jsonl")
    code, output = check("--target", target, "--hypothesis-profile", "ci", cwd=tmp_path)
    assert code == 2, output
    assert "hello: features must be a list of at most 64 names" in output
    assert "programs run │ 0" in output
