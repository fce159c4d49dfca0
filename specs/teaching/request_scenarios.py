"""Request-layer scenarios: stories of requests told on the KV cache manager's model.

A request scenario is data, like a pool scenario (``scenarios``): a manager
configuration (``ManagerSetup``) and steps, each an operation with JSON
arguments and one sentence of narration. The operations are those of
``kvpool.model.manager`` plus the scheduler's moves on a request value:

========================== ===================================================
``new_request``            a request arrives: its prompt is hashed (no manager call)
``run_model``              the GPU ran a step: the request has computed
                           ``num_computed_tokens`` tokens and sampled ``sampled``
``preempt``                ``manager.free`` and the request forgets what it computed
``get_computed_blocks``    the cache-hit lookup; remembered per request
``allocate_slots``         ``new_computed_blocks: "lookup"`` passes the request's
                           last lookup (blocks and token count) as its hits
``free``, ``cache_blocks``, ``evict_blocks``, ``reset_prefix_cache``,
``take_events``, ``get_block_ids``, ``get_num_common_prefix_blocks``,
``make_prefix_cache_stats``, ``usage``, ``num_free_blocks``: the manager's calls
========================== ===================================================

Requests are named by id. ``run`` applies the steps to the model and yields an
``Outcome`` per step: the ``World`` (manager state and requests) before and
after, the JSON result or the rejection's class name, and the events.

**The file format** (``kvpool explain FILE``) is JSON lines, one scenario a
line, so that a request-layer counterexample or vector can be told the same
way::

    {"layer": "request", "format_version": 1, "id": "story/hit", "description": "...",
     "config": {"num_blocks": 8, "groups": [{"attention": "full_attention", "block_size": 2}],
                "max_model_len": 16, "hash_block_size": 2, "enable_caching": true,
                "use_eagle": false, "log_stats": false, "enable_events": false,
                "profile": "hashless-first"},
     "steps": [{"op": "new_request", "args": {"request_id": "a", "prompt": [1, 2, 3]},
                "say": "optional narration", "expect": {"ok": ...} or {"error": "Name"}}]}

Everything read from a file is parsed as data and bounded (``MAX_*``); a file
that breaks a rule is a ``ScenarioError`` naming the line and the field.
``dump_line`` writes the format, ``record`` turns a list of calls into it.
The built-in scenarios are in ``request_stories``.

>>> story = RequestScenario("s", "a lookup", setup(4, [full_attention(2)]),
...     (arrive("a", "ABC", "A request arrives."), lookup("a", "Nothing is cached yet.")))
>>> [o.result for o in run(story)][-1]
{'blocks': [[]], 'num_tokens': 0}
"""

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpool.model import PROFILES, BlockHash, KVCacheEvent, PoolError, PoolState
from kvpool.model import manager as mm
from kvpool.model import request as rq
from kvpool.model import scheduler_calls as sc
from kvpool.model.hashing import LoraAdapter, MultiModalInput
from kvpool.model.manager import Blocks, KVCacheManagerState
from kvpool.model.request import Request
from kvpool.model.single_type import (
    AttentionType,
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)
from kvpool.specs.protocol.codec import Json, encode_event, loads
from kvpool.specs.request import target
from kvpool.specs.request.target import (
    ManagerSetup,
    eagle_arguments,
    geometry_arguments,
    retention_arguments,
)
from kvpool.specs.teaching.scenarios import ScenarioError, Step

LAYER = "request"
FORMAT_VERSION = 1

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_STEPS = 2000
MAX_BLOCKS = 4096
MAX_GROUPS = 8
MAX_TOKENS = 65536
MAX_ID = 64
"""Bounds on what a scenario file may ask for: the model is O(blocks) per call."""

# --------------------------------------------------------------------------
# The world a request scenario runs in
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """The KV cache manager, the requests the scheduler knows, and their last lookups."""

    manager: KVCacheManagerState
    requests: Mapping[str, Request] = field(default_factory=dict)
    """Live requests (arrived, not finished), in arrival order."""
    lookups: Mapping[str, tuple[Blocks, int]] = field(default_factory=dict)
    """Each request's last ``get_computed_blocks`` answer."""
    labels: Mapping[BlockHash, str] = field(default_factory=dict)
    """A readable name for every hash a request of the scenario was given."""

    @property
    def pool(self) -> PoolState:
        """The block pool every group shares."""
        return self.manager.managers.pool


@dataclass(frozen=True)
class RequestScenario:
    """A named story of requests: a manager configuration and the steps played on it."""

    name: str
    title: str
    setup: ManagerSetup
    steps: tuple[Step, ...]
    summary: str = ""
    expected: tuple[Mapping[str, Json] | None, ...] = ()
    """For scenarios read from a file: each step's recorded ``expect`` (or None)."""

    def with_profile(self, profile: str) -> "RequestScenario":
        """The same steps on a manager whose pool follows another semantics profile."""
        return replace(
            self,
            name=f"{self.name}@{profile}",
            setup=replace(self.setup, profile=PROFILES[profile]),
        )


@dataclass(frozen=True)
class Outcome:
    """What one step did: the worlds around it, its result and the events it emitted."""

    index: int
    step: Step
    before: World
    state: World
    """The world after the step (the world before it if the step was rejected)."""
    result: Json
    error: str | None
    """The rejection's class name (``kvpool.model``'s exceptions), or None."""
    events: tuple[KVCacheEvent, ...]
    mismatch: str | None = None
    """For a step read from a file: how the model's answer differs from the recorded one."""

    @property
    def changed(self) -> frozenset[int]:
        """Pool blocks the step changed: ref count, keys, or in or out of the free queue."""
        before, after = self.before.pool, self.state.pool
        was_free, now_free = set(before.free_queue), set(after.free_queue)
        return frozenset(
            b
            for b in range(after.config.num_blocks)
            if before.blocks[b] != after.blocks[b] or (b in was_free) != (b in now_free)
        )


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def new_world(setup: ManagerSetup) -> World:
    """The manager of ``setup`` holding nothing, and no request."""
    manager = mm.new_kv_cache_manager(
        setup.num_blocks,
        setup.specs,
        setup.max_model_len,
        hash_block_size=setup.hash_block_size,
        enable_caching=setup.enable_caching,
        use_eagle=setup.use_eagle,
        log_stats=setup.log_stats,
        enable_events=setup.enable_events,
        profile=setup.profile,
        fine_grained_hits=setup.fine_grained_hits,
        max_in_flight_tokens=setup.max_in_flight_tokens,
        num_prefill_lookahead=setup.num_prefill_lookahead,
        **geometry_arguments(setup),
        **retention_arguments(setup),
        eagle_groups=setup.eagle_groups,
    )
    return World(manager)


def initial_state(scenario: RequestScenario) -> World:
    """The world the scenario starts from."""
    return new_world(scenario.setup)


def run(scenario: RequestScenario) -> Iterator[Outcome]:
    """Apply the steps to the model, one ``Outcome`` per step.

    A step the model rejects leaves the world as it was and reports the
    rejection; the run goes on.
    """
    world = initial_state(scenario)
    for index, step in enumerate(scenario.steps, 1):
        before = world
        result: Json = None
        error: str | None = None
        try:
            world, result = apply(world, step.op, step.args)
        except PoolError as rejection:
            error = type(rejection).__name__
            world = before
        pending_before = before.pool.pending_events
        events: tuple[KVCacheEvent, ...] = ()
        if step.op != "take_events":
            events = world.pool.pending_events[len(pending_before) :]
        mismatch = None
        if index <= len(scenario.expected):
            mismatch = _compare(scenario.expected[index - 1], result, error)
        yield Outcome(index, step, before, world, result, error, events, mismatch)


def final_state(scenario: RequestScenario) -> World:
    """The world after the last step."""
    world = initial_state(scenario)
    for outcome in run(scenario):
        world = outcome.state
    return world


def apply(world: World, op: str, args: Mapping[str, Json]) -> tuple[World, Json]:
    """One step on the model: the new world and the step's JSON result.

    Raises the model's exception (a ``PoolError``) when it rejects the call,
    ``ScenarioError`` when the step itself is malformed.
    """
    a = decode_args(op, args)
    kv = world.manager
    if op == "new_request":
        request = rq.new_request(
            a["request_id"],
            a["prompt"],
            a["hash_block_size"] or world.pool.config.hash_block_size,
            lora=a["lora"],
            mm_inputs=a["mm_inputs"],
            cache_salt=a["cache_salt"],
            skip_reading_prefix_cache=a["skip_reading_prefix_cache"],
        )
        world = _with_request(world, request)
        return world, [h.hex() for h in request.block_hashes]
    if op in (
        "free",
        "cache_blocks",
        "get_computed_blocks",
        "get_computed_blocks_with_boundary",
        "allocate_slots",
        "run_model",
        "estimate_cached_tokens",
        "get_computed_blocks_for_connector",
        "finalize_partial_tail_offloads",
    ):
        request = _request(world, a["request_id"])
    if op == "run_model":
        request = rq.with_computed(request, a["num_computed_tokens"])
        request = rq.append_tokens(request, a["sampled"])
        return _with_request(world, request), None
    if op == "preempt":
        request = _request(world, a["request_id"])
        kv, _ = mm.free(kv, request.request_id)
        world = replace(world, manager=kv)
        return _with_request(world, rq.preempted(request)), None
    if op == "get_computed_blocks":
        kv, (blocks, num) = mm.get_computed_blocks(kv, request)
        lookups = {**world.lookups, request.request_id: (blocks, num)}
        return replace(world, manager=kv, lookups=lookups), {
            "blocks": _blocks_json(blocks),
            "num_tokens": num,
        }
    if op == "get_computed_blocks_with_boundary":
        kv, (blocks, num, boundary) = mm.get_computed_blocks_with_boundary(kv, request)
        lookups = {**world.lookups, request.request_id: (blocks, num)}
        world = _noting_boundary(world, request, boundary)
        return replace(world, manager=kv, lookups=lookups), {
            "blocks": _blocks_json(blocks),
            "num_tokens": num,
            "boundary": boundary,
        }
    if op == "take_kv_cache_block_copies":
        kv, (copies, retained) = mm.take_kv_cache_block_copies(kv)
        return replace(world, manager=kv), {
            "copies": [list(pair) for pair in copies],
            "retained": list(retained),
        }
    if op == "free_blocks":
        kv, _ = mm.free_blocks(kv, a["block_ids"])
        return replace(world, manager=kv), None
    if op == "truncate_computed_blocks":
        cut = mm.truncate_computed_blocks(kv, a["blocks"], a["num_computed_tokens"])
        return world, _blocks_json(cut)
    if op == "take_new_block_ids":
        kv, ids = mm.take_new_block_ids(kv)
        return replace(world, manager=kv), list(ids)
    if op == "estimate_cached_tokens":
        return world, mm.estimate_cached_tokens(kv, request.request_id)
    if op == "new_step_starts":
        kv, _ = mm.new_step_starts(kv)
        return replace(world, manager=kv), None
    if op == "allocate_slots":
        hits: Blocks | None = a["new_computed_blocks"]
        num_hit: int = a["num_new_computed_tokens"]
        if a["from_lookup"]:
            if request.request_id not in world.lookups:
                raise ScenarioError(f"allocate_slots: {request.request_id!r} was never looked up")
            hits, num_hit = world.lookups[request.request_id]
        kv, new = mm.allocate_slots(
            kv,
            request,
            a["num_new_tokens"],
            num_hit,
            hits,
            a["num_lookahead_tokens"],
            a["delay_cache_blocks"],
            a["full_sequence_must_fit"],
            num_external_computed_tokens=a["num_external_computed_tokens"],
            reserved_blocks=a["reserved_blocks"],
            skip_zeroing_group_ids=a["skip_zeroing_group_ids"],
        )
        return replace(world, manager=kv), None if new is None else _blocks_json(new)
    if op == "pop_blocks_for_free":
        rid = a["request_id"]
        kv, popped = sc.pop_blocks_for_free(kv, rid)
        requests = {r: v for r, v in world.requests.items() if r != rid}
        lookups = {r: v for r, v in world.lookups.items() if r != rid}
        return replace(world, manager=kv, requests=requests, lookups=lookups), list(popped)
    if op == "remove_skipped_blocks":
        kv, _ = sc.remove_skipped_blocks(kv, a["request_id"], a["processed_computed_tokens"])
        return replace(world, manager=kv), None
    if op == "get_block_ids_for_computed_tokens":
        cut = sc.get_block_ids_for_computed_tokens(kv, a["request_id"], a["num_computed_tokens"])
        return world, _blocks_json(cut)
    if op == "get_computed_blocks_for_connector":
        kv, (blocks, num, boundary, diverged) = sc.get_computed_blocks_for_connector(kv, request)
        lookups = {**world.lookups, request.request_id: (blocks, num)}
        world = _noting_boundary(world, request, boundary)
        return replace(world, manager=kv, lookups=lookups), {
            "blocks": _blocks_json(blocks),
            "num_tokens": num,
            "boundary": boundary,
            "hit_diverged": diverged,
        }
    if op == "record_blocks_for_zeroing":
        kv, _ = sc.record_blocks_for_zeroing(kv, a["request_id"], a["start_token"])
        return replace(world, manager=kv), None
    if op == "take_boundary_state_offloads":
        kv, offloads = sc.take_boundary_state_offloads(kv)
        return replace(world, manager=kv), {
            rid: [list(entry) for entry in entries] for rid, entries in offloads.items()
        }
    if op == "finalize_partial_tail_offloads":
        kv, tails = sc.finalize_partial_tail_offloads(kv, request)
        return replace(world, manager=kv), [list(t) for t in tails]
    if op == "free":
        kv, _ = mm.free(kv, request.request_id)
        requests = {r: v for r, v in world.requests.items() if r != request.request_id}
        lookups = {r: v for r, v in world.lookups.items() if r != request.request_id}
        return replace(world, manager=kv, requests=requests, lookups=lookups), None
    if op == "cache_blocks":
        kv, _ = mm.cache_blocks(kv, request, a["num_computed_tokens"])
        return replace(world, manager=kv), None
    if op == "evict_blocks":
        kv, _ = mm.evict_blocks(kv, a["block_ids"])
        return replace(world, manager=kv), None
    if op == "reset_prefix_cache":
        kv, done = mm.reset_prefix_cache(kv)
        return replace(world, manager=kv), done
    if op == "take_events":
        kv, events = mm.take_events(kv)
        return replace(world, manager=kv), [encode_event(e) for e in events]
    if op == "make_prefix_cache_stats":
        kv, stats = mm.make_prefix_cache_stats(kv)
        shown = None if stats is None else dict(vars(stats))
        return replace(world, manager=kv), shown
    if op == "get_block_ids":
        return world, _blocks_json(mm.get_block_ids(kv, a["request_id"]))
    if op == "get_num_common_prefix_blocks":
        return world, list(mm.get_num_common_prefix_blocks(kv, a["request_id"]))
    if op == "usage":
        return world, mm.usage(kv)
    assert op == "num_free_blocks"
    return world, mm.num_free_blocks(kv)


def hash_label_of(request: Request, index: int) -> str:
    """A readable name for the request's hash ``index``: its prefix's tokens, and tags.

    Tokens that are printable ASCII read as letters. The tags name what else
    went into the hash: ``@lora``, ``$salt``, ``+image``.

    >>> r = rq.new_request("a", b"ABCD", 2, cache_salt="s")
    >>> hash_label_of(r, 0), hash_label_of(r, 1)
    ('AB$s', 'ABCD$s')
    """
    tokens = request.all_token_ids[: (index + 1) * request.hash_block_size]
    text = tokens_text(tokens)
    tags = ""
    if request.lora is not None:
        tags += f"@{request.lora.name}"
    if request.cache_salt:
        tags += f"${request.cache_salt}"
    end = len(tokens)
    tags += "".join(f"+{m.identifier}" for m in request.mm_inputs if m.offset < end)
    return text + tags


def tokens_text(tokens: Sequence[int], width: int = 12) -> str:
    """Tokens as letters when all are printable ASCII, else numbers; long ones keep their end.

    >>> tokens_text(b"ABC"), tokens_text([1, 2]), tokens_text(b"ABCDEFGHIJKLMN", 6)
    ('ABC', '1 2', '…JKLMN')
    """
    if tokens and all(33 <= t < 127 for t in tokens):
        text = bytes(tokens).decode("ascii")
    else:
        text = " ".join(str(t) for t in tokens)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _noting_boundary(world: World, request: Request, boundary: int) -> World:
    """Under sparse retention the scheduler keeps a lookup's shared-prefix boundary on the
    request, where caching reads it (``kvpool.model.retention``), as the request machine
    does; under dense retention nothing reads it."""
    if world.manager.config.retention_interval is None:
        return world
    return _with_request(world, replace(request, shared_prefix_boundary=boundary))


def _with_request(world: World, request: Request) -> World:
    labels = dict(world.labels)
    for i, h in enumerate(request.block_hashes):
        labels.setdefault(h, hash_label_of(request, i))
    requests = {**world.requests, request.request_id: request}
    return replace(world, requests=requests, labels=labels)


def _request(world: World, request_id: str) -> Request:
    if request_id not in world.requests:
        raise ScenarioError(f"no live request {request_id!r} in this scenario")
    return world.requests[request_id]


def _blocks_json(blocks: Blocks) -> list[Json]:
    return [list(group) for group in blocks]


def _compare(expected: Mapping[str, Json] | None, result: Json, error: str | None) -> str | None:
    if expected is None:
        return None
    if "error" in expected:
        if error == expected["error"]:
            return None
        got = f"rejects it with {error}" if error else f"returns {json.dumps(result)}"
        return f"the file expects {expected['error']}; the model now {got}"
    if error is not None:
        return (
            f"the file expects {json.dumps(expected.get('ok'))}; the model rejects it with {error}"
        )
    want = expected.get("ok")
    if isinstance(want, float) and isinstance(result, float) and math.isclose(want, result):
        return None
    if want == result:
        return None
    return f"the file expects {json.dumps(want)}; the model now returns {json.dumps(result)}"


# --------------------------------------------------------------------------
# Arguments: decoded strictly, as data
# --------------------------------------------------------------------------

OPERATIONS = (
    "new_request",
    "run_model",
    "preempt",
    *(op for op in target.OPERATIONS if op != "snapshot"),
    *target.OPERATIONS_033,
    *target.OPERATIONS_SCHEDULER,
)
"""Every operation a request scenario may use: the scheduler's own three steps, then the
request layer's operations (``kvpool.specs.request.target``) with vLLM 0.33's further calls."""

SCHEDULER_MOVES = ("new_request", "run_model", "preempt")
"""The operations that are the scheduler's, not the manager's (``preempt`` is both)."""

_ARGS: dict[str, tuple[str, ...]] = {
    "new_request": (
        "request_id",
        "prompt",
        "lora",
        "mm_inputs",
        "cache_salt",
        "skip_reading_prefix_cache",
        "hash_block_size",
    ),
    "run_model": ("request_id", "num_computed_tokens", "sampled"),
    "preempt": ("request_id",),
    "get_computed_blocks": ("request_id",),
    "allocate_slots": (
        "request_id",
        "num_new_tokens",
        "num_new_computed_tokens",
        "new_computed_blocks",
        "num_lookahead_tokens",
        "delay_cache_blocks",
        "full_sequence_must_fit",
        "num_external_computed_tokens",
        "reserved_blocks",
        "skip_zeroing_group_ids",
    ),
    "free": ("request_id",),
    "cache_blocks": ("request_id", "num_computed_tokens"),
    "evict_blocks": ("block_ids",),
    "reset_prefix_cache": (),
    "take_events": (),
    "make_prefix_cache_stats": (),
    "get_block_ids": ("request_id",),
    "get_num_common_prefix_blocks": ("request_id",),
    "usage": (),
    "num_free_blocks": (),
    "get_computed_blocks_with_boundary": ("request_id",),
    "take_kv_cache_block_copies": (),
    "free_blocks": ("block_ids",),
    "truncate_computed_blocks": ("blocks", "num_computed_tokens"),
    "take_new_block_ids": (),
    "estimate_cached_tokens": ("request_id",),
    "new_step_starts": (),
    "pop_blocks_for_free": ("request_id",),
    "remove_skipped_blocks": ("request_id", "processed_computed_tokens"),
    "get_block_ids_for_computed_tokens": ("request_id", "num_computed_tokens"),
    "get_computed_blocks_for_connector": ("request_id",),
    "record_blocks_for_zeroing": ("request_id", "start_token"),
    "take_boundary_state_offloads": (),
    "finalize_partial_tail_offloads": ("request_id",),
}
_REQUIRED = {
    "new_request": ("request_id", "prompt"),
    "run_model": ("request_id", "num_computed_tokens"),
    "allocate_slots": ("request_id", "num_new_tokens"),
    "cache_blocks": ("request_id", "num_computed_tokens"),
    "evict_blocks": ("block_ids",),
    "free_blocks": ("block_ids",),
    "truncate_computed_blocks": ("blocks", "num_computed_tokens"),
    "remove_skipped_blocks": ("request_id", "processed_computed_tokens"),
    "get_block_ids_for_computed_tokens": ("request_id", "num_computed_tokens"),
    "record_blocks_for_zeroing": ("request_id", "start_token"),
}


def decode_args(op: str, args: Mapping[str, Json]) -> dict[str, Any]:
    """The step's arguments as Python values; ScenarioError says what is wrong.

    Integers stay integers (the model rejects negative counts with its own
    exceptions, which is part of what a scenario may show); sizes are bounded.

    >>> decode_args("free", {"request_id": "a"})
    {'request_id': 'a'}
    """
    if op not in _ARGS:
        raise ScenarioError(f"unknown operation {op!r}; known: {', '.join(OPERATIONS)}")
    if not isinstance(args, Mapping):
        raise ScenarioError(f"{op}: args must be an object")
    unknown = sorted(set(args) - set(_ARGS[op]))
    if unknown:
        raise ScenarioError(f"{op}: unknown argument(s) {', '.join(unknown)}")
    for name in _REQUIRED.get(op, ("request_id",) if "request_id" in _ARGS[op] else ()):
        if name not in args:
            raise ScenarioError(f"{op}: missing argument {name}")
    out: dict[str, Any] = {}
    if "request_id" in _ARGS[op]:
        out["request_id"] = _text(args["request_id"], f"{op}: request_id", MAX_ID)
    if op == "new_request":
        out["prompt"] = _tokens(args["prompt"], "new_request: prompt")
        out["lora"] = _lora(args.get("lora"))
        out["mm_inputs"] = _mm_inputs(args.get("mm_inputs", []))
        salt = args.get("cache_salt")
        out["cache_salt"] = None if salt is None else _text(salt, "cache_salt", MAX_ID, empty=True)
        out["skip_reading_prefix_cache"] = _flag(args, "skip_reading_prefix_cache")
        size = args.get("hash_block_size")
        out["hash_block_size"] = None if size is None else _count(size, "hash_block_size")
    elif op == "run_model":
        out["num_computed_tokens"] = _count(args["num_computed_tokens"], "num_computed_tokens")
        out["sampled"] = _tokens(args.get("sampled", []), "run_model: sampled")
    elif op == "allocate_slots":
        out["num_new_tokens"] = _count(args["num_new_tokens"], "num_new_tokens")
        out["num_lookahead_tokens"] = _count(
            args.get("num_lookahead_tokens", 0), "num_lookahead_tokens"
        )
        out["delay_cache_blocks"] = _flag(args, "delay_cache_blocks")
        out["full_sequence_must_fit"] = _flag(args, "full_sequence_must_fit")
        for name in ("num_external_computed_tokens", "reserved_blocks"):
            out[name] = _count(args.get(name, 0), name)
        out["skip_zeroing_group_ids"] = _ids(
            args.get("skip_zeroing_group_ids", []), "allocate_slots: skip_zeroing_group_ids"
        )
        hits = args.get("new_computed_blocks")
        out["from_lookup"] = hits == "lookup"
        if hits == "lookup" and "num_new_computed_tokens" in args:
            raise ScenarioError("allocate_slots: a hit from the lookup comes with its own count")
        out["num_new_computed_tokens"] = _count(
            args.get("num_new_computed_tokens", 0), "num_new_computed_tokens"
        )
        out["new_computed_blocks"] = None if hits in (None, "lookup") else _groups(hits)
    elif op == "cache_blocks":
        out["num_computed_tokens"] = _count(args["num_computed_tokens"], "num_computed_tokens")
    elif op in ("evict_blocks", "free_blocks"):
        out["block_ids"] = _ids(args["block_ids"], f"{op}: block_ids")
    elif op == "truncate_computed_blocks":
        out["blocks"] = _groups(args["blocks"])
        out["num_computed_tokens"] = _count(args["num_computed_tokens"], "num_computed_tokens")
    elif op in ("remove_skipped_blocks", "get_block_ids_for_computed_tokens"):
        name = _ARGS[op][1]
        out[name] = _count(args[name], name)
    elif op == "record_blocks_for_zeroing":
        out["start_token"] = _count(args["start_token"], "start_token")
    return out


def _text(value: Json, what: str, limit: int, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > limit:
        raise ScenarioError(f"{what} must be a string of 1 to {limit} characters, got {value!r}")
    return value


def _count(value: Json, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_TOKENS:
        raise ScenarioError(f"{what} must be an integer of at most {MAX_TOKENS}, got {value!r}")
    return value


def _flag(args: Mapping[str, Json], name: str) -> bool:
    value = args.get(name, False)
    if not isinstance(value, bool):
        raise ScenarioError(f"{name} must be true or false, got {value!r}")
    return value


def _tokens(value: Json, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_TOKENS:
        raise ScenarioError(f"{what} must be a list of at most {MAX_TOKENS} token ids")
    return tuple(_count(t, f"{what} token") for t in value)


def _ids(value: Json, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS:
        raise ScenarioError(f"{what} must be a list of at most {MAX_BLOCKS} block ids")
    return tuple(_count(b, f"{what} entry") for b in value)


def _groups(value: Json) -> Blocks:
    if not isinstance(value, list) or len(value) > MAX_GROUPS:
        raise ScenarioError(
            'new_computed_blocks must be null, "lookup" or a list of block-id lists, one per group'
        )
    return tuple(_ids(g, "new_computed_blocks") for g in value)


def _lora(value: Json) -> LoraAdapter | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"id", "name", "path"}:
        raise ScenarioError('lora must be null or {"id": int, "name": str, "path": str}')
    return LoraAdapter(
        _count(value.get("id", 1), "lora id"),
        _text(value.get("name"), "lora name", MAX_ID),
        _text(value.get("path", ""), "lora path", MAX_ID, empty=True),
    )


def _mm_inputs(value: Json) -> tuple[MultiModalInput, ...]:
    if not isinstance(value, list) or len(value) > MAX_GROUPS:
        raise ScenarioError(f"mm_inputs must be a list of at most {MAX_GROUPS} inputs")
    inputs = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"identifier", "offset", "length"}:
            raise ScenarioError(
                'each mm input is {"identifier": str, "offset": int, "length": int}'
            )
        inputs.append(
            MultiModalInput(
                _text(item["identifier"], "mm identifier", MAX_ID),
                _count(item["offset"], "mm offset"),
                _count(item["length"], "mm length"),
            )
        )
    return tuple(inputs)


# --------------------------------------------------------------------------
# The configuration, as JSON
# --------------------------------------------------------------------------


def encode_spec(spec: KVCacheSpec) -> dict[str, Json]:
    """A group's spec as JSON.

    >>> encode_spec(sliding_window(2, 4))
    {'attention': 'sliding_window', 'block_size': 2, 'sliding_window': 4}
    """
    out: dict[str, Json] = {"attention": spec.attention.value, "block_size": spec.block_size}
    if spec.attention is AttentionType.SLIDING_WINDOW:
        out["sliding_window"] = spec.sliding_window
    if spec.attention is AttentionType.CHUNKED_LOCAL:
        out["attention_chunk_size"] = spec.attention_chunk_size
    return out


def decode_spec(value: Json) -> KVCacheSpec:
    """A group's spec from JSON; ScenarioError if it is not one."""
    kinds = {t.value: t for t in AttentionType}
    if not isinstance(value, dict) or value.get("attention") not in kinds:
        raise ScenarioError(
            f"a group is {{'attention': one of {sorted(kinds)}, ...}}, got {value!r}"
        )
    kind = kinds[str(value["attention"])]
    allowed = {"attention", "block_size"}
    allowed |= {"sliding_window"} if kind is AttentionType.SLIDING_WINDOW else set()
    allowed |= {"attention_chunk_size"} if kind is AttentionType.CHUNKED_LOCAL else set()
    if set(value) != allowed:
        raise ScenarioError(f"a {kind.value} group has exactly the fields {sorted(allowed)}")
    size = _count(value["block_size"], "block_size")
    if kind is AttentionType.FULL:
        return full_attention(size)
    if kind is AttentionType.SLIDING_WINDOW:
        return sliding_window(size, _count(value["sliding_window"], "sliding_window"))
    if kind is AttentionType.CHUNKED_LOCAL:
        return chunked_local(size, _count(value["attention_chunk_size"], "attention_chunk_size"))
    return mamba(size)


def encode_setup(setup: ManagerSetup) -> dict[str, Json]:
    """The manager configuration as JSON."""
    return {
        "num_blocks": setup.num_blocks,
        "groups": [encode_spec(s) for s in setup.specs],
        "max_model_len": setup.max_model_len,
        "hash_block_size": setup.hash_block_size,
        "enable_caching": setup.enable_caching,
        "use_eagle": setup.use_eagle,
        "log_stats": setup.log_stats,
        "enable_events": setup.enable_events,
        "profile": setup.profile.name,
        # written only when on, so that files of earlier programs stay as they were
        **({"fine_grained_hits": True} if setup.fine_grained_hits else {}),
        **(
            {}
            if setup.max_in_flight_tokens is None
            else {"max_in_flight_tokens": setup.max_in_flight_tokens}
        ),
        **(
            {"num_prefill_lookahead": setup.num_prefill_lookahead}
            if setup.num_prefill_lookahead
            else {}
        ),
        **geometry_arguments(setup),
        **retention_arguments(setup),
        **eagle_arguments(setup),
    }


GEOMETRY_FIELDS = ("scheduler_block_size", "dcp_world_size", "pcp_world_size")
"""The block geometry's fields, written only when they differ from the defaults."""


def decode_setup(value: Json) -> ManagerSetup:
    """The manager configuration from JSON, bounded; the model then checks the rest."""
    if not isinstance(value, dict):
        raise ScenarioError("config must be an object")
    known = {
        *encode_setup(_EXAMPLE_SETUP),
        "fine_grained_hits",
        "max_in_flight_tokens",
        "num_prefill_lookahead",
        "retention_interval",
        *GEOMETRY_FIELDS,
        "eagle_groups",
    }
    unknown = sorted(set(value) - known)
    if unknown:
        raise ScenarioError(f"config: unknown field(s) {', '.join(unknown)}")
    for name in ("num_blocks", "groups", "max_model_len", "hash_block_size"):
        if name not in value:
            raise ScenarioError(f"config: missing field {name}")
    num_blocks = _count(value["num_blocks"], "num_blocks")
    if not 1 <= num_blocks <= MAX_BLOCKS:
        raise ScenarioError(f"num_blocks must be 1 to {MAX_BLOCKS}, got {num_blocks}")
    groups = value["groups"]
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ScenarioError(f"groups must be a list of 1 to {MAX_GROUPS} groups")
    profile = value.get("profile", "hashless-first")
    if profile not in PROFILES:
        raise ScenarioError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    caching = value.get("enable_caching", True)
    if not isinstance(caching, bool):
        raise ScenarioError(f"enable_caching must be true or false, got {caching!r}")
    chosen = ManagerSetup(
        num_blocks=num_blocks,
        specs=tuple(decode_spec(g) for g in groups),
        max_model_len=_count(value["max_model_len"], "max_model_len"),
        hash_block_size=_count(value["hash_block_size"], "hash_block_size"),
        enable_caching=caching,
        use_eagle=_flag(value, "use_eagle"),
        log_stats=_flag(value, "log_stats"),
        enable_events=_flag(value, "enable_events"),
        profile=PROFILES[str(profile)],
        fine_grained_hits=_flag(value, "fine_grained_hits"),
        max_in_flight_tokens=(
            None
            if value.get("max_in_flight_tokens") is None
            else _count(value["max_in_flight_tokens"], "max_in_flight_tokens")
        ),
        num_prefill_lookahead=_count(
            value.get("num_prefill_lookahead", 0), "num_prefill_lookahead"
        ),
        scheduler_block_size=(
            _count(value["scheduler_block_size"], "scheduler_block_size")
            if "scheduler_block_size" in value
            else None
        ),
        dcp_world_size=_count(value.get("dcp_world_size", 1), "dcp_world_size"),
        pcp_world_size=_count(value.get("pcp_world_size", 1), "pcp_world_size"),
        # the model names a negative or misplaced interval (InvalidManagerConfig) below
        retention_interval=(
            _count(value["retention_interval"], "retention_interval")
            if value.get("retention_interval") is not None
            else None
        ),
        eagle_groups=_ids(value.get("eagle_groups", []), "config: eagle_groups"),
    )
    try:
        new_world(chosen)
    except PoolError as error:
        raise ScenarioError(f"config: the model cannot build this manager: {error}") from error
    return chosen


_EXAMPLE_SETUP = ManagerSetup(2, (full_attention(1),), 1, 1)


# --------------------------------------------------------------------------
# Files: one scenario per line
# --------------------------------------------------------------------------


def encode(scenario: RequestScenario, expect: bool = True) -> dict[str, Json]:
    """The scenario as one JSON object of the file format, with the model's answers.

    ``expect`` records each step's answer (``{"ok": ...}`` or ``{"error": ...}``),
    as a counterexample or a vector would.
    """
    outcomes = list(run(scenario)) if expect else []
    steps: list[Json] = []
    for i, step in enumerate(scenario.steps):
        item: dict[str, Json] = {"op": step.op, "args": dict(step.args)}
        if step.say:
            item["say"] = step.say
        if expect:
            o = outcomes[i]
            item["expect"] = {"error": o.error} if o.error else {"ok": o.result}
        steps.append(item)
    return {
        "layer": LAYER,
        "format_version": FORMAT_VERSION,
        "id": scenario.name,
        "description": scenario.title,
        "config": encode_setup(scenario.setup),
        "steps": steps,
    }


def dump_line(scenario: RequestScenario, expect: bool = True) -> str:
    """The scenario as one line of a request scenario file."""
    return json.dumps(encode(scenario, expect), separators=(",", ":"))


def record(
    setup: ManagerSetup,
    calls: Sequence[tuple[str, Mapping[str, Json]]],
    scenario_id: str,
    description: str = "",
) -> str:
    """A file line for ``calls`` (op and JSON args) on a manager built from ``setup``.

    The hook for a request-layer counterexample or vector: a machine that
    records its calls in these terms hands them here, and ``kvpool explain``
    tells the story, marking any step whose recorded answer the model no
    longer gives.
    """
    steps = tuple(Step(op, dict(args)) for op, args in calls)
    return dump_line(RequestScenario(scenario_id, description, setup, steps))


def decode(data: Json, where: str = "scenario") -> RequestScenario:
    """A request scenario from one parsed line of the file format."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{where}: a scenario is a JSON object")
    if data.get("layer") != LAYER:
        raise ScenarioError(f'{where}: not a request-layer scenario ("layer": "{LAYER}")')
    if data.get("format_version") != FORMAT_VERSION:
        raise ScenarioError(f"{where}: format_version must be {FORMAT_VERSION}")
    unknown = sorted(
        set(data) - {"layer", "format_version", "id", "description", "config", "steps"}
    )
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {', '.join(unknown)}")
    name = data.get("id", "scenario")
    title = data.get("description", "")
    if not isinstance(name, str) or not isinstance(title, str) or len(title) > 1000:
        raise ScenarioError(f"{where}: id and description must be strings")
    try:
        setup = decode_setup(data.get("config"))
    except ScenarioError as error:
        raise ScenarioError(f"{where}: {error}") from None
    raw = data.get("steps")
    if not isinstance(raw, list) or len(raw) > MAX_STEPS:
        raise ScenarioError(f"{where}: steps must be a list of at most {MAX_STEPS} steps")
    steps: list[Step] = []
    expected: list[Mapping[str, Json] | None] = []
    for n, item in enumerate(raw, 1):
        at = f"{where} step {n}"
        if not isinstance(item, dict) or set(item) - {"op", "args", "say", "expect"}:
            raise ScenarioError(f"{at}: a step is {{op, args, say?, expect?}}")
        op, args, say = item.get("op"), item.get("args", {}), item.get("say", "")
        if not isinstance(op, str) or not isinstance(args, dict) or not isinstance(say, str):
            raise ScenarioError(f"{at}: op must be a string, args an object, say a string")
        try:
            decode_args(op, args)
        except ScenarioError as error:
            raise ScenarioError(f"{at}: {error}") from None
        expect = item.get("expect")
        if expect is not None and (
            not isinstance(expect, dict) or len(expect) != 1 or set(expect) - {"ok", "error"}
        ):
            raise ScenarioError(f'{at}: expect is {{"ok": value}} or {{"error": "Name"}}')
        steps.append(Step(op, args, say))
        expected.append(expect)
    _check_references(steps, where)
    return RequestScenario(name, title, setup, tuple(steps), expected=tuple(expected))


def _check_references(steps: Sequence[Step], where: str) -> None:
    """Every request a step names arrived in an earlier step and has not finished."""
    live: set[str] = set()
    looked_up: set[str] = set()
    sizes: dict[str, int] = {}
    for n, step in enumerate(steps, 1):
        rid = step.args.get("request_id")
        grown = step.args.get("prompt" if step.op == "new_request" else "sampled")
        if step.op in ("new_request", "run_model") and isinstance(grown, list):
            before = sizes.get(str(rid), 0) if step.op == "run_model" else 0
            sizes[str(rid)] = before + len(grown)
            if sizes[str(rid)] > MAX_TOKENS:
                raise ScenarioError(
                    f"{where} step {n}: request {rid!r} exceeds {MAX_TOKENS} tokens"
                )
        if step.op == "new_request":
            if rid in live:
                raise ScenarioError(f"{where} step {n}: request {rid!r} is already live")
            live.add(str(rid))
        elif rid is not None and rid not in live and step.op not in _QUERIES_BY_ID:
            raise ScenarioError(f"{where} step {n}: {step.op} names request {rid!r}, not live")
        elif step.op in ("get_computed_blocks", "get_computed_blocks_with_boundary"):
            looked_up.add(str(rid))
        elif step.op == "allocate_slots" and step.args.get("new_computed_blocks") == "lookup":
            if rid not in looked_up:
                raise ScenarioError(f"{where} step {n}: {rid!r} takes a lookup it never made")
        elif step.op == "free":
            live.discard(str(rid))
            looked_up.discard(str(rid))


_QUERIES_BY_ID = ("get_block_ids", "get_num_common_prefix_blocks")
"""Queries that may name any id: a request holding nothing answers empty."""


def is_request_file(path: Path) -> bool:
    """Whether ``path``'s first line is a request-layer scenario (``"layer": "request"``)."""
    try:
        with path.open(encoding="utf-8") as file:
            for line in file:
                if line.strip():
                    first = loads(line)  # bounded: a hostile file is data, never a crash
                    return isinstance(first, dict) and first.get("layer") == LAYER
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return False


def load(path: Path, scenario_id: str | None = None) -> RequestScenario:
    """The scenario of a request scenario file; ``scenario_id`` picks one of several."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ScenarioError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ScenarioError(f"{path}: cannot read: {error}") from error
    found: list[tuple[int, Json]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                found.append((number, loads(line)))
            except ValueError as error:
                raise ScenarioError(f"{path.name} line {number}: not JSON: {error}") from None
    if not found:
        raise ScenarioError(f"{path}: holds no scenario")
    if scenario_id is None:
        if len(found) > 1:
            ids = ", ".join(str(d.get("id")) for _, d in found[:10] if isinstance(d, dict))
            raise ScenarioError(f"{path} holds {len(found)} scenarios; pick one: {ids}")
        number, data = found[0]
        return decode(data, f"{path.name} line {number}")
    for number, data in found:
        if isinstance(data, dict) and data.get("id") == scenario_id:
            return decode(data, f"{path.name} line {number}")
    raise ScenarioError(f"{path}: no scenario with id {scenario_id!r}")


# --------------------------------------------------------------------------
# Building scenarios
# --------------------------------------------------------------------------


def tokens(text: str) -> list[int]:
    """Token ids for a text, one letter a token (so pictures read them back as letters).

    >>> tokens("AB")
    [65, 66]
    """
    return list(text.encode("ascii"))


def arrive(rid: str, prompt: str, say: str, **extra: Json) -> Step:
    return Step("new_request", {"request_id": rid, "prompt": tokens(prompt), **extra}, say)


def lookup(rid: str, say: str) -> Step:
    return Step("get_computed_blocks", {"request_id": rid}, say)


def allocate(rid: str, num_new: int, say: str, hit: bool = False, **extra: Json) -> Step:
    args: dict[str, Json] = {"request_id": rid, "num_new_tokens": num_new, **extra}
    if hit:
        args["new_computed_blocks"] = "lookup"
    return Step("allocate_slots", args, say)


def computed(rid: str, num: int, say: str, sampled: str = "") -> Step:
    return Step(
        "run_model",
        {"request_id": rid, "num_computed_tokens": num, "sampled": tokens(sampled)},
        say,
    )


def finish(rid: str, say: str) -> Step:
    return Step("free", {"request_id": rid}, say)


def preempt(rid: str, say: str) -> Step:
    return Step("preempt", {"request_id": rid}, say)


def setup(
    num_blocks: int,
    specs: Sequence[KVCacheSpec],
    max_model_len: int = 32,
    hash_block_size: int = 2,
    enable_events: bool = False,
) -> ManagerSetup:
    return ManagerSetup(
        num_blocks=num_blocks,
        specs=tuple(specs),
        max_model_len=max_model_len,
        hash_block_size=hash_block_size,
        enable_events=enable_events,
    )
