"""Writing the request layer's conformance vectors: scenarios, seeded walks and hash vectors.

``generate_request_corpus()`` builds the corpus from the model alone,
deterministically: hand-written scenarios for each attention type and for
hybrid layouts, seeded walks of a scheduler at levels 1 and 2 (driven by
``random.Random(seed)``, the way the request-level machine drives a target),
and hash vectors that check a hasher alone. The committed copy lives in
``specs/vectors/data/request/`` (JSON lines plus ``manifest.json``)::

    kvpool vectors export --layer request DIR
"""

import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvpool.model import PROFILES, PoolError
from kvpool.model.hashing import (
    LoraAdapter,
    MultiModalInput,
    block_extra_keys,
    block_preimage,
    extend_block_hashes,
    none_hash,
)
from kvpool.model.request import (
    Request,
    append_tokens,
    new_request,
    preempted,
    with_computed,
)
from kvpool.model.single_type import (
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import Json, encode_hash
from kvpool.specs.request.machine import MAX_MODEL_LEN, STEM, VARIANTS, layout_specs
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import HYBRID_LAYOUTS, LAYOUTS, ManagerSetup
from kvpool.specs.vectors.format import (
    FORMAT_VERSION,
    GENERATOR,
    MANIFEST,
    REQUEST_FORMAT,
    sha256,
)

REQUEST_GENERATOR_VERSION = 3
"""Bumped whenever generate_request_corpus() produces a different corpus."""

QUERIES = ("get_block_ids", "usage", "num_free_blocks")
"""Operations that change nothing, which a walk sends now and then."""


# --------------------------------------------------------------------------
# Writing vectors: a script runs operations on the model and records them
# --------------------------------------------------------------------------


class ManagerScript:
    """Builds one manager vector: each call runs an operation on the model and records the step."""

    def __init__(
        self, vector_id: str, description: str, tags: Sequence[str], setup: ManagerSetup
    ) -> None:
        self.id = vector_id
        self.description = description
        self.tags = list(tags)
        self.setup = setup
        self.manager = ModelManagerTarget(setup)
        self.steps: list[dict[str, Json]] = []
        self._last_state: Json = None

    def __call__(self, op: str, *args: Any) -> Any:
        """Run ``op`` with ``ManagerTarget``'s Python arguments; its result, or None if rejected."""
        json_args = codec.encode_args(op, *args)
        expect: dict[str, Json]
        result: Any = None
        try:
            encoded = codec.apply(self.manager, op, json_args)
            result = codec.decode_result(op, encoded)
            expect = {"ok": encoded}
        except PoolError as error:
            expect = {"error": type(error).__name__}
        self._record({"op": op, "args": json_args, "expect": expect})
        return result

    def _record(self, step: dict[str, Json]) -> None:
        """Keep ``step``, with the state after it when the step changed it (or is the first)."""
        state = codec.encode_manager_state(self.manager.state)
        if state != self._last_state:
            step["state"] = state
            self._last_state = state
        self.steps.append(step)

    def accepts(self, op: str, *args: Any) -> bool:
        """Whether the model accepts ``op`` now (nothing is recorded or changed)."""
        before = self.manager.state
        try:
            codec.apply(self.manager, op, codec.encode_args(op, *args))
        except PoolError:
            return False
        finally:
            self.manager.state = before
        return True

    def vector(self) -> dict[str, Json]:
        level = 2 if any("error" in s["expect"] for s in self.steps) else 1
        return {
            "kind": "manager",
            "id": self.id,
            "description": self.description,
            "tags": self.tags,
            "level": level,
            "setup": codec.encode_setup(self.setup),
            "steps": self.steps,
        }


def manager_vector_from_calls(
    setup: ManagerSetup,
    calls: Sequence[tuple[str, dict[str, Json]]],
    vector_id: str,
    description: str,
    tags: Sequence[str] = (),
) -> dict[str, Json]:
    """A vector replaying ``calls`` (operation, JSON arguments) on the model."""
    script = ManagerScript(vector_id, description, tags, setup)
    for op, json_args in calls:
        expect: dict[str, Json]
        try:
            expect = {"ok": codec.apply(script.manager, op, json_args)}
        except PoolError as error:
            expect = {"error": type(error).__name__}
        script._record({"op": op, "args": json_args, "expect": expect})
    return script.vector()


def setup_of(
    specs: Sequence[KVCacheSpec],
    num_blocks: int = 8,
    hash_block_size: int = 1,
    max_model_len: int = MAX_MODEL_LEN,
    **options: Any,
) -> ManagerSetup:
    return ManagerSetup(num_blocks, tuple(specs), max_model_len, hash_block_size, **options)


class Run:
    """One request's life in a scenario: admit it, compute chunks, append tokens, free it."""

    def __init__(self, s: ManagerScript, request: Request) -> None:
        self.s = s
        self.request = request

    def admit(self, num_new: int | None = None, delay: bool = False) -> Any:
        """Look up the hits, then allocate ``num_new`` tokens (default: the rest of the prompt)."""
        hit, num_hit = None, 0
        if self.s.setup.enable_caching:
            found = self.s("get_computed_blocks", self.request)
            if found is not None:
                hit, num_hit = found
        n = self.request.num_tokens - num_hit if num_new is None else num_new
        blocks = self.s("allocate_slots", self.request, n, num_hit, hit, 0, delay)
        if blocks is not None:
            self.request = with_computed(self.request, num_hit + n)
        return blocks

    def chunk(self, num_new: int) -> Any:
        """Allocate the next ``num_new`` prompt tokens of a running request."""
        blocks = self.s("allocate_slots", self.request, num_new)
        if blocks is not None:
            self.request = with_computed(self.request, self.request.num_computed_tokens + num_new)
        return blocks

    def decode(self, token: int, lookahead: int = 0) -> Any:
        """Append a sampled token, then allocate its slot."""
        self.request = append_tokens(self.request, [token])
        blocks = self.s("allocate_slots", self.request, 1, 0, None, lookahead)
        if blocks is not None:
            self.request = with_computed(self.request, self.request.num_tokens)
        return blocks

    def free(self) -> None:
        self.s("free", self.request)

    def preempt(self) -> None:
        self.s("free", self.request)
        self.request = preempted(self.request)

    def tables(self) -> Any:
        return self.s("get_block_ids", self.request.request_id)


# --------------------------------------------------------------------------
# Hand-written scenarios
# --------------------------------------------------------------------------

Scenario = Callable[[], Iterator[ManagerScript]]
SCENARIOS: list[Scenario] = []


def scenario(function: Scenario) -> Scenario:
    SCENARIOS.append(function)
    return function


@scenario
def full_attention_scenarios() -> Iterator[ManagerScript]:
    s = ManagerScript(
        "full/prefix-hit",
        "a finished request's blocks stay cached; a later request with the same prefix hits "
        "them, never its last token",
        ["full", "hits", "stats"],
        setup_of([full_attention(2)], num_blocks=8, hash_block_size=2, log_stats=True),
    )
    a = Run(s, new_request("a", [1, 2, 3, 4, 5], 2))
    a.admit()
    a.decode(6)
    a.tables()
    a.free()
    b = Run(s, new_request("b", [1, 2, 3, 4, 9, 9], 2))
    b.admit()
    b.tables()
    c = Run(s, new_request("c", [1, 2, 3, 4], 2))
    c.admit()
    s("get_num_common_prefix_blocks", "b")
    s("make_prefix_cache_stats")
    s("make_prefix_cache_stats")
    s("usage")
    s("num_free_blocks")
    yield s

    s = ManagerScript(
        "full/pressure",
        "an allocation the pool cannot serve is refused with null and changes nothing; free "
        "hits count as blocks to take; eviction takes the oldest free block",
        ["full", "eviction", "refusal"],
        setup_of([full_attention(1)], num_blocks=5),
    )
    a = Run(s, new_request("a", [1, 2, 1], 1))
    a.admit()
    big = Run(s, new_request("big", [2, 2, 2], 1))
    big.admit()
    a.free()
    big.free()
    again = Run(s, new_request("again", [1, 2, 1, 2], 1))
    again.admit()
    s("num_free_blocks")
    other = Run(s, new_request("other", [2, 1, 1], 1))
    other.admit()
    yield s

    s = ManagerScript(
        "full/extra-keys",
        "the same tokens with another LoRA adapter, cache salt, image or prompt embeddings "
        "never hit each other's blocks; the same extra keys do",
        ["full", "hits", "extra-keys"],
        setup_of([full_attention(2)], num_blocks=12, hash_block_size=2),
    )
    tokens = [300, 70000, 5, 6, 7]
    flavours: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("lora", {"lora": LoraAdapter(1, "a", "/a")}),
        ("salt", {"cache_salt": "a"}),
        ("image", {"mm_inputs": [MultiModalInput("img", 1, 2)]}),
        ("embeds", {"prompt_embeds": [b"e1", b"e2", b"e3", b"e4", b"e5"]}),
    ]
    for name, extra in flavours:
        run = Run(s, new_request(f"{name}-1", tokens, 2, **extra))
        run.admit()
        run.free()
    for name, extra in flavours:
        Run(s, new_request(f"{name}-2", tokens, 2, **extra)).admit()
    yield s

    s = ManagerScript(
        "full/eagle",
        "with EAGLE the last matched block is not a hit: the drafter recomputes it",
        ["full", "eagle", "hits"],
        setup_of([full_attention(1)], num_blocks=8, use_eagle=True),
    )
    a = Run(s, new_request("a", [1, 2, 2, 1], 1))
    a.admit()
    a.free()
    Run(s, new_request("b", [1, 2, 2, 1, 1], 1)).admit()
    yield s

    s = ManagerScript(
        "full/delayed-caching",
        "delay_cache_blocks leaves full blocks out of the map until cache_blocks; "
        "cache_blocks never goes back",
        ["full", "cache-blocks"],
        setup_of([full_attention(2)], num_blocks=6, hash_block_size=2, enable_events=True),
    )
    a = Run(s, new_request("a", [1, 2, 3, 4, 5], 2))
    a.admit(delay=True)
    s("get_computed_blocks", new_request("probe", [1, 2, 3, 4, 5], 2))
    s("cache_blocks", a.request, 4)
    s("cache_blocks", a.request, 2)
    s("take_events")
    s("get_computed_blocks", new_request("probe", [1, 2, 3, 4, 5], 2))
    yield s

    s = ManagerScript(
        "full/preemption",
        "a preempted request frees everything and is admitted again with its own cached "
        "blocks; its lookup is counted apart in the stats",
        ["full", "preemption", "stats"],
        setup_of([full_attention(1)], num_blocks=6, log_stats=True),
    )
    a = Run(s, new_request("a", [1, 2, 1, 2], 1))
    a.admit()
    a.decode(2)
    a.preempt()
    a.admit()
    s("make_prefix_cache_stats")
    yield s


@scenario
def other_attention_scenarios() -> Iterator[ManagerScript]:
    s = ManagerScript(
        "sliding-window/skipped-blocks",
        "blocks entirely before the window are freed as the request advances; nulls take "
        "their place; a hit needs only the window's blocks",
        ["sliding_window", "hits"],
        setup_of([sliding_window(2, 3)], num_blocks=10, hash_block_size=2),
    )
    a = Run(s, new_request("a", [1, 2, 3, 4, 5, 6, 7], 2))
    a.admit(num_new=4)
    a.chunk(3)
    a.tables()
    a.decode(8)
    a.tables()
    a.free()
    Run(s, new_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)).admit()
    s("get_block_ids", "b")
    yield s

    s = ManagerScript(
        "chunked-local/earlier-chunks",
        "blocks of earlier chunks count as computed (null); the hit continues in the current "
        "chunk; every block of an old chunk is released, the last cached one too",
        ["chunked_local", "hits"],
        setup_of([chunked_local(2, 4)], num_blocks=10, hash_block_size=2),
    )
    a = Run(s, new_request("a", [1, 2, 3, 4, 5, 6, 7], 2))
    a.admit()
    a.decode(8)
    a.decode(9)
    a.tables()
    a.free()
    Run(s, new_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9], 2)).admit()
    s("get_block_ids", "b")
    yield s

    s = ManagerScript(
        "mamba/never-cached",
        "a Mamba group holds one state block per request: never a hit, never cached",
        ["mamba"],
        setup_of([mamba(16)], num_blocks=4, hash_block_size=2, enable_events=True),
    )
    a = Run(s, new_request("a", [1, 2, 3, 4], 2))
    a.admit()
    a.decode(5)
    a.free()
    Run(s, new_request("b", [1, 2, 3, 4, 5], 2)).admit()
    s("take_events")
    yield s


@scenario
def hybrid_scenarios() -> Iterator[ManagerScript]:
    layouts: list[tuple[str, list[KVCacheSpec], str]] = [
        (
            "full+sliding_window",
            [full_attention(1), sliding_window(1, 2)],
            "the window group shortens the full-attention hit to where both are cached",
        ),
        (
            "full+full+sliding_window",
            [full_attention(1), full_attention(1), sliding_window(1, 2)],
            "two groups of one spec are searched together",
        ),
        (
            "sliding_window+full",
            [sliding_window(1, 2), full_attention(1)],
            "the window group listed first: full attention is still searched first",
        ),
        (
            "full+chunked_local",
            [full_attention(2), chunked_local(2, 4)],
            "chunked local attention beside full attention",
        ),
    ]
    for name, specs, description in layouts:
        hbs = specs[0].block_size
        s = ManagerScript(
            f"hybrid/{name}",
            description,
            ["hybrid", *sorted({spec.attention.value for spec in specs})],
            setup_of(specs, num_blocks=14, hash_block_size=hbs, enable_events="chunked" in name),
        )
        a = Run(s, new_request("a", [1, 2, 1, 1, 2, 2], hbs))
        a.admit()
        a.decode(1)
        b = Run(s, new_request("b", [1, 2, 1, 1, 2, 2, 2, 2], hbs))
        b.admit()
        a.free()
        s("evict_blocks", {3})
        c = Run(s, new_request("c", [1, 2, 1, 1, 2, 2, 1], hbs))
        c.admit()
        s("get_num_common_prefix_blocks", "c")
        b.free()
        c.free()
        s("take_events")
        s("reset_prefix_cache")
        s("take_events")
        yield s


@scenario
def maintenance_scenarios() -> Iterator[ManagerScript]:
    s = ManagerScript(
        "maintenance/reset-and-evict",
        "reset is refused while a request holds blocks, done once none does (the stats say "
        "so); evict_blocks drops a block's hash and nothing else",
        ["reset", "eviction", "stats", "events"],
        setup_of([full_attention(1)], num_blocks=6, log_stats=True, enable_events=True),
    )
    a = Run(s, new_request("a", [2, 1, 2], 1))
    a.admit()
    s("reset_prefix_cache")
    s("evict_blocks", {1, 2})
    s("take_events")
    a.free()
    s("reset_prefix_cache")
    s("make_prefix_cache_stats")
    s("take_events")
    yield s

    s = ManagerScript(
        "maintenance/caching-off",
        "without prefix caching nothing hits and nothing is cached",
        ["caching-off"],
        setup_of([full_attention(1)], num_blocks=5, enable_caching=False),
    )
    a = Run(s, new_request("a", [1, 2, 1], 1))
    a.admit()
    a.free()
    s("get_computed_blocks", new_request("b", [1, 2, 1], 1))
    s("cache_blocks", new_request("a", [1, 2, 1], 1), 3)
    yield s


@scenario
def rejection_scenarios() -> Iterator[ManagerScript]:
    """Level 2: every precondition of the request layer, each rejected with nothing changed."""
    s = ManagerScript(
        "rejections/allocate-slots",
        "every way allocate_slots can be misused, in the model's order of checks",
        ["rejections"],
        setup_of([full_attention(1), sliding_window(1, 2)], num_blocks=8),
    )
    r = new_request("r", [1, 2, 1], 1)
    s("allocate_slots", new_request("stranger", [1, 2, 1], 2), 1)
    s("allocate_slots", r, 0)
    s("allocate_slots", r, 1, -1)
    s("allocate_slots", r, 1, 0, None, -1)
    s("allocate_slots", r, 1, 0, ((1,),))
    s("allocate_slots", r, 1, 0, ((9,), ()))
    s("allocate_slots", r, 1)
    s("allocate_slots", with_computed(r, 1), 1, 0, ((1,), (2,)))
    s("get_computed_blocks", new_request("stranger", [1, 2, 1], 2))
    s("cache_blocks", new_request("nobody", [1, 2], 1), 2)
    s("evict_blocks", {-1})
    s("evict_blocks", {8})
    yield s

    s = ManagerScript(
        "rejections/caching-off-hits",
        "hits passed to a manager without prefix caching",
        ["rejections", "caching-off"],
        setup_of([full_attention(1)], num_blocks=4, enable_caching=False),
    )
    s("allocate_slots", new_request("r", [1, 2], 1), 1, 1, ((1,),))
    yield s


# --------------------------------------------------------------------------
# Seeded walks of a scheduler
# --------------------------------------------------------------------------

WALK_SEED = 20251115
WALK_STEPS = 28


class Walk:
    """A scheduler's random life of requests over one manager, recorded as a vector."""

    def __init__(self, rng: random.Random, s: ManagerScript, level: int) -> None:
        self.rng = rng
        self.s = s
        self.level = level
        self.requests: dict[str, Request] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.next_id = 0

    def call(self, op: str, *args: Any) -> tuple[bool, Any]:
        """Record ``op`` if the model accepts it (or always at level 2): (accepted, result)."""
        accepted = self.s.accepts(op, *args)
        if not accepted and self.level < 2:
            return False, None
        return accepted, self.s(op, *args)

    def add(self) -> None:
        rng = self.rng
        shared = rng.choice([12, 10, 8, 6, 4, 3, 0])
        tail = [rng.choice([1, 2, 300]) for _ in range(rng.randint(0, 3))]
        prompt = (list(STEM[:shared]) + tail)[:12] or [1]
        flavour = dict(VARIANTS[rng.choice(["plain"] * 4 + sorted(VARIANTS))])
        for m in flavour.get("mm_inputs", ()):
            if m.offset + m.length > len(prompt):
                flavour.pop("mm_inputs")
        if rng.random() < 0.1:
            flavour = {"prompt_embeds": [bytes([t % 251]) for t in prompt]}
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = new_request(rid, prompt, self.s.setup.hash_block_size, **flavour)
        self.waiting.append(rid)

    def admit(self) -> None:
        rid = self.rng.choice(self.waiting)
        request = self.requests[rid]
        hit, num_hit = None, 0
        if self.s.setup.enable_caching:
            _, found = self.call("get_computed_blocks", request)
            if found is not None:
                hit, num_hit = found
        num_new = min(self.rng.randint(1, 12), request.num_tokens - num_hit)
        delay = self.rng.random() < 0.2
        ok, blocks = self.call("allocate_slots", request, num_new, num_hit, hit, 0, delay)
        if not ok or blocks is None:
            return
        self.waiting.remove(rid)
        self.running.append(rid)
        self.compute(with_computed(request, num_hit), num_new, ())

    def step(self) -> None:
        rng = self.rng
        rid = rng.choice(self.running)
        request = self.requests[rid]
        num_real = min(rng.randint(1, 12), request.num_tokens - request.num_computed_tokens)
        reaches_end = request.num_computed_tokens + num_real == request.num_tokens
        room = MAX_MODEL_LEN - request.num_tokens - 1
        drafts = [rng.randint(1, 2) for _ in range(rng.randint(0, 2))]
        draft = tuple(drafts[: max(0, room)]) if reaches_end else ()
        lookahead = rng.randint(0, 2)
        num_new = num_real + len(draft)
        ok, blocks = self.call("allocate_slots", request, num_new, 0, None, lookahead)
        if ok and blocks is not None:
            self.compute(request, num_new, draft)

    def compute(self, request: Request, num_new: int, draft: tuple[int, ...]) -> None:
        rid = request.request_id
        computed = request.num_computed_tokens + num_new
        if computed < request.num_tokens:
            self.requests[rid] = with_computed(request, computed)
            return
        accepted = draft[: self.rng.randint(0, len(draft))]
        old = request.num_tokens
        request = append_tokens(request, (*accepted, self.rng.choice([1, 2, 300])))
        request = with_computed(request, old + len(accepted))
        self.requests[rid] = request
        if request.num_tokens >= MAX_MODEL_LEN:
            self.call("free", request)
            self.forget(rid)

    def leave(self) -> None:
        rng = self.rng
        if self.running and rng.random() < 0.5:
            rid = rng.choice(self.running)
            self.call("free", self.requests[rid])
            self.running.remove(rid)
            self.waiting.append(rid)
            self.requests[rid] = preempted(self.requests[rid])
            return
        rid = rng.choice(self.running + self.waiting)
        self.call("free", self.requests[rid])
        self.forget(rid)

    def forget(self, rid: str) -> None:
        for queue in (self.running, self.waiting):
            if rid in queue:
                queue.remove(rid)
        del self.requests[rid]

    def maintain(self) -> None:
        rng = self.rng
        action = rng.choice(
            ["cache_blocks", "common_prefix", "evict", "reset", "events", "stats", "query"]
        )
        if action == "cache_blocks" and self.running:
            request = self.requests[rng.choice(self.running)]
            self.call("cache_blocks", request, request.num_computed_tokens)
        elif action == "common_prefix" and self.running:
            self.call("get_num_common_prefix_blocks", rng.choice(self.running))
        elif action == "evict":
            ids = {rng.randint(1, 11) for _ in range(rng.randint(0, 3))}
            self.call("evict_blocks", {b for b in ids if b < self.s.setup.num_blocks})
        elif action == "reset":
            self.call("reset_prefix_cache")
        elif action == "events":
            self.call("take_events")
        elif action == "stats":
            self.call("make_prefix_cache_stats")
        elif action == "query":
            op = rng.choice(QUERIES)
            if op == "get_block_ids":
                rid = rng.choice([*self.running, *self.waiting, "nobody"])
                self.call(op, rid)
            else:
                self.call(op)

    def raw(self) -> None:
        """Level 2: a call no scheduler should make, which the model rejects."""
        rng = self.rng
        everyone = self.running + self.waiting
        kind = rng.choice(["allocate", "stranger", "cache_blocks", "evict", "unknown"])
        if kind == "allocate" and everyone:
            request = self.requests[rng.choice(everyone)]
            hits = None
            if rng.random() < 0.5:
                hits = tuple(
                    tuple(rng.randint(0, 17) for _ in range(rng.randint(0, 2)))
                    for _ in range(rng.randint(0, 3))
                )
            self.call(
                "allocate_slots",
                request,
                rng.randint(-1, 2),
                rng.randint(-1, 2),
                hits,
                rng.randint(-1, 1),
            )
        elif kind == "stranger":
            request = new_request("stranger", [1, 2, 1], self.s.setup.hash_block_size + 1)
            op = rng.choice(["get_computed_blocks", "allocate_slots"])
            if op == "get_computed_blocks":
                self.call(op, request)
            else:
                self.call(op, request, 1)
        elif kind == "cache_blocks" and self.running:
            request = self.requests[rng.choice(self.running)]
            self.call("cache_blocks", request, rng.randint(-1, MAX_MODEL_LEN + 1))
        elif kind == "unknown":
            nobody = new_request("nobody", [1, 2], self.s.setup.hash_block_size)
            self.call("cache_blocks", nobody, 2)
        else:
            self.call("evict_blocks", {rng.choice([-1, self.s.setup.num_blocks, 1000])})

    def move(self) -> None:
        rng = self.rng
        moves = ["add", "admit", "step", "leave", "maintain"] + (["raw"] if self.level >= 2 else [])
        weights = [4, 5, 4, 3, 2] + ([2] if self.level >= 2 else [])
        move = rng.choices(moves, weights=weights)[0]
        if move == "add" and len(self.running) + len(self.waiting) < 5:
            self.add()
        elif move == "admit" and self.waiting:
            self.admit()
        elif move == "step" and self.running:
            self.step()
        elif move == "leave" and (self.running or self.waiting):
            self.leave()
        elif move == "maintain":
            self.maintain()
        elif move == "raw":
            self.raw()


def request_walk(
    seed: int, level: int, layout: str, common_scope: bool = False, steps: int = WALK_STEPS
) -> dict[str, Json]:
    """One seeded walk of a scheduler over ``layout``; the same arguments give the same vector.

    ``common_scope`` keeps to what most engines are checked on (blocks of
    hash-block size, events off, the default profile, windows of two tokens
    or more), which is vLLM's scope.
    """
    rng = random.Random(seed)
    hbs = rng.choice([1, 2])
    factor = 1 if common_scope else rng.choice([1, 2])
    window = rng.randint(2 if common_scope else 1, 6)
    specs = layout_specs(layout, hbs * factor, window, rng.randint(1, 3), MAX_MODEL_LEN, hbs)
    eagle = rng.random() < 0.25 and layout in ("full", "sliding_window")
    profile = "hashless-first" if common_scope else rng.choice(list(PROFILES))
    setup = ManagerSetup(
        num_blocks=rng.randint(5, 14),
        specs=specs,
        max_model_len=MAX_MODEL_LEN,
        hash_block_size=hbs,
        enable_caching=rng.random() < 0.85,
        use_eagle=eagle,
        log_stats=rng.random() < 0.5,
        enable_events=False if common_scope else rng.random() < 0.5,
        profile=PROFILES[profile],
    )
    scope_tag = ["common-scope"] if common_scope else []
    s = ManagerScript(
        f"walk/level{level}/{layout}/{seed}",
        f"a scheduler's seeded walk over {layout}, seed {seed}",
        ["random-walk", layout, f"profile:{profile}", *scope_tag],
        setup,
    )
    walk = Walk(rng, s, level)
    walk.add()
    budget = steps * 20
    while len(s.steps) < steps and budget > 0:
        budget -= 1
        walk.move()
    return s.vector()


def walks(level: int) -> list[dict[str, Json]]:
    """The seeded walks of ``level``: every layout, some of them in the common scope."""
    layouts = LAYOUTS if level == 1 else (*LAYOUTS, *HYBRID_LAYOUTS)
    found: list[dict[str, Json]] = []
    seed = WALK_SEED + 1000 * level
    for layout in layouts:
        for common in (False, True) if level == 1 else (False,):
            for _ in range(2):
                seed += 1
                if common and layout in ("chunked_local", "mamba"):
                    continue
                found.append(request_walk(seed, level, layout, common))
    return found


# --------------------------------------------------------------------------
# Hash vectors: the hasher alone
# --------------------------------------------------------------------------


def model_block_hashes(request: Request) -> tuple[bytes, ...]:
    """The model's hashes of every full hash block of ``request`` (its own hashes ignored)."""
    return extend_block_hashes(
        (),
        request.all_token_ids,
        request.hash_block_size,
        request.lora,
        request.mm_inputs,
        request.cache_salt,
        seed_hash=request.seed_hash,
        prompt_embeds=request.prompt_embeds,
    )


def preimages(request: Request) -> list[str]:
    """The hex of each block's canonical encoding (what SHA-256 hashes), as a debugging aid."""
    found = []
    parent: bytes | None = None
    tokens = request.all_token_ids
    size = request.hash_block_size
    for i, block_hash in enumerate(model_block_hashes(request)):
        start, end = i * size, (i + 1) * size
        extra = block_extra_keys(
            start, end, request.lora, request.mm_inputs, request.cache_salt, request.prompt_embeds
        )
        found.append(
            block_preimage(parent, tokens[start:end], extra, seed_hash=request.seed_hash).hex()
        )
        parent = block_hash
    return found


def hash_vector(
    vector_id: str, description: str, tags: Sequence[str], request: Request
) -> dict[str, Json]:
    """A vector: the block hashes of ``request`` (or the model's rejection of it)."""
    args = {"request": {**codec.encode_request(request), "block_hashes": []}}
    step: dict[str, Json] = {"op": "block_hashes", "args": args}
    try:
        hashes = model_block_hashes(request)
    except PoolError as error:
        step["expect"] = {"error": type(error).__name__}
        level = 2
    else:
        step["expect"] = {"ok": [encode_hash(h) for h in hashes]}
        step["preimages"] = preimages(request)
        level = 1
    return {
        "kind": "hash",
        "id": vector_id,
        "description": description,
        "tags": ["hash", *tags],
        "level": level,
        "steps": [step],
    }


def raw_request(request_id: str, tokens: Sequence[int], hbs: int, **fields: Any) -> Request:
    """A request built without the hasher's checks (for vectors the hasher must reject)."""
    return Request(request_id, tuple(tokens), hbs, **fields)


def hash_vectors() -> list[dict[str, Json]]:
    """Root hashes, then block hashes for every kind of extra key and their tagging."""
    found: list[dict[str, Json]] = []
    for seed, why in [
        ("kvpool-none-hash", "the default seed: every first block chains from this root"),
        ("another deployment", "another seed: caches that must never share a block"),
        ("", "an empty seed"),
        ("μ-cache", "a seed outside ASCII (UTF-8 encoded)"),
    ]:
        found.append(
            {
                "kind": "hash",
                "id": f"hash/root/{seed or 'empty'}",
                "description": f"the root hash of seed {seed!r}: {why}",
                "tags": ["hash", "root"],
                "level": 1,
                "steps": [
                    {
                        "op": "none_hash",
                        "args": {"seed": seed},
                        "expect": {"ok": encode_hash(none_hash(seed))},
                    }
                ],
            }
        )
    tokens = [1, 2, 3, 4, 5]
    image = MultiModalInput("img-0", 1, 3)
    cases: list[tuple[str, str, list[str], Request]] = [
        ("tokens/hbs-1", "a block per token", ["tokens"], new_request("r", tokens, 1)),
        (
            "tokens/hbs-2",
            "the trailing partial block is not hashed",
            ["tokens"],
            new_request("r", tokens, 2),
        ),
        ("tokens/hbs-3", "blocks of three tokens", ["tokens"], new_request("r", [*tokens, 6], 3)),
        (
            "tokens/large-ids",
            "token ids of 256 and above: integers as decimal text, never bytes",
            ["tokens", "large-ids"],
            new_request("r", [0, 255, 256, 300, 65535, 65536, 2**31, 2**53], 2),
        ),
        (
            "tokens/output",
            "prompt and output tokens hash as one sequence",
            ["tokens", "output"],
            append_tokens(new_request("r", [1, 2, 3], 2), [4, 5]),
        ),
        (
            "tokens/seed",
            "the first block chains from the request's seed hash",
            ["tokens", "root"],
            new_request("r", tokens, 2, seed_hash=none_hash("another deployment")),
        ),
        (
            "lora/name-and-path",
            "a LoRA adapter keys every block by name and path (its id only feeds events)",
            ["lora"],
            new_request("r", tokens, 2, lora=LoraAdapter(7, "adapter", "/adapters/a")),
        ),
        (
            "lora/other-id",
            "the same adapter under another id: the same hashes as lora/name-and-path",
            ["lora"],
            new_request("r", tokens, 2, lora=LoraAdapter(8, "adapter", "/adapters/a")),
        ),
        (
            "lora/other-path",
            "the same name re-pointed at another path: other hashes",
            ["lora"],
            new_request("r", tokens, 2, lora=LoraAdapter(7, "adapter", "/adapters/b")),
        ),
        (
            "lora/no-path",
            "an adapter without a path (the empty string)",
            ["lora"],
            new_request("r", tokens, 2, lora=LoraAdapter(1, "adapter")),
        ),
        (
            "salt/first-block",
            "a cache salt keys the first block only (and the rest through the chain)",
            ["salt"],
            new_request("r", tokens, 2, cache_salt="tenant-a"),
        ),
        (
            "salt/empty",
            "an empty salt is no salt: the same hashes as tokens/hbs-2",
            ["salt"],
            new_request("r", tokens, 2, cache_salt=""),
        ),
        (
            "mm/spanning",
            "an image over tokens 1-3 keys both blocks it overlaps, with its offset from each "
            "block's start (negative in the second)",
            ["mm"],
            new_request("r", tokens, 2, mm_inputs=[image]),
        ),
        (
            "mm/two-images",
            "two images in input order, one per block and one sharing a block",
            ["mm"],
            new_request(
                "r",
                [1, 2, 3, 4, 5, 6],
                2,
                mm_inputs=[MultiModalInput("a", 0, 1), MultiModalInput("b", 1, 3)],
            ),
        ),
        (
            "mm/ends-at-boundary",
            "an image ending where a block starts does not key that block",
            ["mm"],
            new_request("r", tokens, 2, mm_inputs=[MultiModalInput("img", 0, 2)]),
        ),
        (
            "embeds/prompt",
            "prompt embeddings key every block by the block's embeddings; a block past the "
            "prompt carries an empty embeddings key",
            ["prompt-embeds"],
            append_tokens(
                new_request("r", [1, 2, 3], 2, prompt_embeds=[b"\x00\x01", b"\xff", b""]), [4]
            ),
        ),
        (
            "tagging/lora-name",
            "tagging: a LoRA adapter named 'tenant'",
            ["tagging", "lora"],
            new_request("r", [1, 2], 2, lora=LoraAdapter(1, "tenant")),
        ),
        (
            "tagging/salt",
            "tagging: a cache salt 'tenant' hashes otherwise than tagging/lora-name",
            ["tagging", "salt"],
            new_request("r", [1, 2], 2, cache_salt="tenant"),
        ),
        (
            "tagging/image",
            "tagging: an image with identifier 'tenant' hashes otherwise than both",
            ["tagging", "mm"],
            new_request("r", [1, 2], 2, mm_inputs=[MultiModalInput("tenant", 0, 2)]),
        ),
        (
            "all-kinds",
            "every kind of extra key at once, in their order: LoRA, images, salt, embeddings",
            ["lora", "mm", "salt", "prompt-embeds"],
            new_request(
                "r",
                [300, 1, 2, 3],
                2,
                lora=LoraAdapter(3, "a", "/a"),
                mm_inputs=[MultiModalInput("img", 1, 2)],
                cache_salt="s",
                prompt_embeds=[b"p", b"q", b"r", b"s"],
            ),
        ),
        (
            "rejected/overlapping-images",
            "images that overlap are rejected",
            ["mm", "rejections"],
            raw_request(
                "r",
                tokens,
                2,
                mm_inputs=(MultiModalInput("a", 0, 2), MultiModalInput("b", 1, 2)),
            ),
        ),
        (
            "rejected/hash-block-size",
            "a hash block of no tokens is rejected",
            ["rejections"],
            raw_request("r", tokens, 0),
        ),
        (
            "rejected/embeddings",
            "more prompt embeddings than tokens are rejected",
            ["prompt-embeds", "rejections"],
            raw_request("r", [1, 2], 1, prompt_embeds=(b"a", b"b", b"c")),
        ),
    ]
    for name, description, tags, request in cases:
        found.append(hash_vector(f"hash/{name}", description, tags, request))
    return found


# --------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------


def generate_request_corpus() -> dict[str, list[dict[str, Json]]]:
    """The whole request-layer corpus, file name to vectors. Deterministic."""
    return {
        "scenarios.jsonl": [script.vector() for make in SCENARIOS for script in make()],
        "walks-level1.jsonl": walks(1),
        "walks-level2.jsonl": walks(2),
        "hashes.jsonl": hash_vectors(),
    }


def dump_line(vector: dict[str, Json]) -> str:
    """A vector as one line of a .jsonl file (compact, keys in a fixed order)."""
    return json.dumps(vector, separators=(",", ":"), ensure_ascii=False)


def export_request_corpus(directory: Path) -> dict[str, Json]:
    """Write the request-layer corpus and its manifest into ``directory``; the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    total = 0
    for name, vectors in generate_request_corpus().items():
        data = "".join(dump_line(v) + "\n" for v in vectors).encode()
        (directory / name).write_bytes(data)
        files.append({"name": name, "count": len(vectors), "sha256": sha256(data)})
        total += len(vectors)
    manifest: dict[str, Json] = {
        "format": REQUEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "generator": f"{GENERATOR}.request_generate",
        "generator_version": REQUEST_GENERATOR_VERSION,
        "count": total,
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
