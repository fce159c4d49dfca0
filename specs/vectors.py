"""Conformance vectors: operation sequences with the model's answers, as JSON lines.

A vector is one test case any implementation can replay without Python: a
pool configuration, then steps, each an operation with its JSON arguments,
what the model answers (``{"ok": result}`` or ``{"error": "ExceptionName"}``)
and the whole state after it. ``generate()`` builds the corpus from the
model alone, deterministically: hand-written scenarios for the tricky cases,
then random walks driven by ``random.Random(seed)``. The committed copy lives
in ``specs/vectors/`` (JSON lines plus ``manifest.json``); the format is in
docs/formats.md and ``specs/schemas/vectors-v1.json``.

::

    kvpool vectors export DIR                 # write the corpus
    kvpool vectors run DIR --target cmd:...   # replay it against any target
"""

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvpool import model
from kvpool.model import PROFILES, PoolConfig, PoolError
from kvpool.specs import protocol
from kvpool.specs.adapters.cmd_target import TargetAbort
from kvpool.specs.adapters.model_target import ModelTarget
from kvpool.specs.machine import request_for
from kvpool.specs.protocol import Json
from kvpool.specs.target import PoolTarget, Snapshottable, TargetError, TargetFactory

FORMAT = "kvpool-vectors"
FORMAT_VERSION = 1
"""The vector format; bumped on any change a consumer could notice (docs/formats.md)."""
GENERATOR = "kvpool.specs.vectors"
GENERATOR_VERSION = 1
"""Bumped whenever generate() produces a different corpus."""
MANIFEST = "manifest.json"


# --------------------------------------------------------------------------
# Writing vectors: a script runs operations on the model and records them
# --------------------------------------------------------------------------


def req(tokens: Sequence[int], hash_block_size: int = 1) -> Json:
    """A request's JSON: the hash of block i is its first (i+1)*hash_block_size tokens.

    >>> req([1, 2, 1])["block_hashes"]
    ['01', '0102', '010201']
    """
    return protocol.encode_request(request_for(tokens, hash_block_size))


class Script:
    """Builds one vector: each call runs an operation on the model and records the step."""

    def __init__(
        self,
        vector_id: str,
        description: str,
        tags: Sequence[str] = (),
        num_blocks: int = 5,
        enable_caching: bool = True,
        hash_block_size: int = 1,
        enable_events: bool = False,
        profile: str = model.DEFAULT_PROFILE.name,
    ) -> None:
        self.config = PoolConfig(
            num_blocks, enable_caching, hash_block_size, enable_events, PROFILES[profile]
        )
        self.id = vector_id
        self.description = description
        self.tags = list(tags)
        self.pool = ModelTarget(self.config)
        self.steps: list[dict[str, Json]] = []

    def __call__(self, op: str, **args: Json) -> Json:
        """Run ``op``; return its result, or None when the model rejects it."""
        expect: dict[str, Json]
        try:
            result = protocol.apply(self.pool, op, args)
            expect = {"ok": result}
        except PoolError as error:
            result = None
            expect = {"error": type(error).__name__}
        state = protocol.encode_state(self.pool.snapshot())
        self.steps.append({"op": op, "args": args, "expect": expect, "state": state})
        return result

    def full(
        self,
        tokens: Sequence[int],
        block_ids: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        group: int = 0,
        mask: list[bool] | None = None,
        request: Json = None,
    ) -> Json:
        """``cache_full_blocks`` for a request of ``tokens`` (or ``request``)."""
        hbs = self.config.hash_block_size
        return self(
            "cache_full_blocks",
            request=req(tokens, hbs) if request is None else request,
            block_ids=block_ids,
            num_cached_blocks=num_cached_blocks,
            num_full_blocks=num_full_blocks,
            block_size=hbs if block_size is None else block_size,
            kv_cache_group_id=group,
            block_mask=mask,
        )

    def partial(
        self,
        tokens: Sequence[int],
        block_id: int,
        num_tokens: int,
        block_size: int,
        group: int = 0,
    ) -> Json:
        """``cache_partial_block`` for a request of ``tokens``."""
        return self(
            "cache_partial_block",
            request=req(tokens, self.config.hash_block_size),
            block_id=block_id,
            num_tokens=num_tokens,
            kv_cache_group_id=group,
            block_size=block_size,
        )

    def accepts(self, op: str, **args: Json) -> bool:
        """Whether the model accepts ``op`` now (nothing is recorded or changed)."""
        before = self.pool.state
        try:
            protocol.apply(self.pool, op, args)
        except PoolError:
            return False
        finally:
            self.pool.state = before
        return True

    def vector(self) -> dict[str, Json]:
        level = 2 if any("error" in s["expect"] for s in self.steps) else 1
        return {
            "id": self.id,
            "description": self.description,
            "tags": self.tags,
            "level": level,
            "config": protocol.encode_config(self.config),
            "steps": self.steps,
        }


def vector_from_calls(
    config: PoolConfig,
    calls: Sequence[tuple[str, dict[str, Json]]],
    vector_id: str,
    description: str,
    tags: Sequence[str] = (),
) -> dict[str, Json]:
    """A vector replaying ``calls`` (operation, JSON arguments) on the model."""
    script = Script(
        vector_id,
        description,
        tags,
        config.num_blocks,
        config.enable_caching,
        config.hash_block_size,
        config.enable_events,
        config.profile.name,
    )
    for op, args in calls:
        script(op, **args)
    return script.vector()


# --------------------------------------------------------------------------
# The corpus: hand-written scenarios
# --------------------------------------------------------------------------

Scenario = Callable[[], Iterator[Script]]
SCENARIOS: list[Scenario] = []


def scenario(function: Scenario) -> Scenario:
    SCENARIOS.append(function)
    return function


@scenario
def basics() -> Iterator[Script]:
    s = Script(
        "basics/allocate-and-free",
        "blocks come from the front; a reverse free puts the last hash-less block first",
        ["basics"],
    )
    s("get_num_free_blocks")
    s("get_new_blocks", num_blocks=2)
    s("get_usage")
    s("free_blocks", block_ids=[2, 1])
    s("get_new_blocks", num_blocks=0)
    s("get_new_blocks", num_blocks=4)
    s("get_usage")
    yield s

    s = Script(
        "basics/null-block",
        "the null block is skipped by touch, free_blocks and caching",
        ["basics", "null-block"],
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=2)
    s("touch", block_ids=[0, 1])
    s.full([1, 2, 1], [0, 1, 2], 0, 3)
    s.partial([1, 2], block_id=0, num_tokens=1, block_size=2)
    s("free_blocks", block_ids=[0, 1, 1, 2])
    s("take_events")
    yield s

    s = Script("basics/one-block-pool", "a pool of only the null block", ["basics"], num_blocks=1)
    s("get_num_free_blocks")
    s("get_usage")
    s("get_new_blocks", num_blocks=0)
    s("reset_prefix_cache")
    yield s


@scenario
def free_order() -> Iterator[Script]:
    """The free-order rule of every profile, caching on and off (docs/semantics.md)."""
    for profile in PROFILES:
        for caching in (True, False):
            name = f"free-order/{profile}/{'caching' if caching else 'no-caching'}"
            tags = ["free-order", f"profile:{profile}", "caching" if caching else "caching-off"]
            s = Script(
                name,
                "free [null, 6, 5, 4, 3, 2, 1] (1 and 3 hashed when caching) onto queue [7, 8, 9]",
                tags,
                num_blocks=10,
                enable_caching=caching,
                profile=profile,
            )
            s("get_new_blocks", num_blocks=9)
            s("free_blocks", block_ids=[7, 8, 9])
            if caching:
                s.full([1, 1, 2], [1, 2, 3], 0, 3, mask=[True, False, True])
            s("free_blocks", block_ids=[0, 6, 5, 4, 3, 2, 1])
            s("get_new_blocks", num_blocks=9)
            yield s

            s = Script(
                f"{name}/twice-held",
                "a block held twice becomes free on its second release only",
                tags,
                num_blocks=4,
                enable_caching=caching,
                profile=profile,
            )
            s("get_new_blocks", num_blocks=3)
            s("touch", block_ids=[2])
            s("free_blocks", block_ids=[3, 2, 1])
            s("free_blocks", block_ids=[2])
            yield s


@scenario
def duplicates() -> Iterator[Script]:
    s = Script(
        "duplicates/first-inserted-wins",
        "two blocks under one hash: lookups return the oldest; after it loses the key, "
        "the next oldest",
        ["duplicate-hashes", "events"],
        num_blocks=6,
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=3)
    for block in (3, 1, 2):
        s.full([1, 2], [block], 0, 1)
    s("get_cached_block", block_hash="01", kv_cache_group_ids=[0])
    s("evict_blocks", block_ids=[3])
    s("get_cached_block", block_hash="01", kv_cache_group_ids=[0])
    s.full([1], [3], 0, 1)
    s("evict_blocks", block_ids=[1, 2])
    s("get_cached_block", block_hash="01", kv_cache_group_ids=[0])
    s("take_events")
    yield s

    s = Script(
        "duplicates/groups",
        "one hash in two groups; a lookup needs every group",
        ["duplicate-hashes", "groups"],
    )
    s("get_new_blocks", num_blocks=2)
    s.full([2, 2], [1, 2], 0, 2, group=1)
    s("get_cached_block", block_hash="0202", kv_cache_group_ids=[1])
    s("get_cached_block", block_hash="0202", kv_cache_group_ids=[0, 1])
    s("get_cached_block", block_hash="0202", kv_cache_group_ids=[])
    s("get_new_blocks", num_blocks=1)
    s.full([2, 2], [3, 1], 0, 1)
    s("get_cached_block", block_hash="02", kv_cache_group_ids=[0, 1])
    yield s


@scenario
def partial_blocks() -> Iterator[Script]:
    s = Script(
        "partial/promotion",
        "a partial key is replaced by a longer one, then by the block's full hash",
        ["partial-blocks", "promotion", "events"],
        num_blocks=4,
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=1)
    s.partial([1, 2, 1, 1], block_id=1, num_tokens=1, block_size=4)
    s.partial([1, 2, 1, 1], block_id=1, num_tokens=1, block_size=4)
    s.partial([1, 2, 1, 1], block_id=1, num_tokens=3, block_size=4)
    s.full([1, 2, 1, 1], [1], 0, 1, block_size=4)
    s.partial([1, 2, 2, 2], block_id=1, num_tokens=2, block_size=4)
    s("get_cached_block", block_hash="0102", kv_cache_group_ids=[0])
    s("take_events")
    s("free_blocks", block_ids=[1])
    s("get_new_blocks", num_blocks=3)
    s("take_events")
    yield s

    s = Script(
        "partial/hash-block-size-2",
        "blocks of 4 tokens, hashes of 2: a block is named by every second hash",
        ["partial-blocks", "block-size", "events"],
        num_blocks=4,
        hash_block_size=2,
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=2)
    s.partial([1, 1, 2, 2, 1, 1], block_id=2, num_tokens=6, block_size=4)
    s.full([1, 1, 2, 2, 1, 1, 2, 2], [1, 2], 0, 2, block_size=4)
    s.full([1, 1, 2, 2, 1, 1, 2, 2], [1, 2], 1, 2, block_size=4, group=1)
    s("take_events")
    yield s


@scenario
def eviction() -> Iterator[Script]:
    s = Script(
        "eviction/under-pressure",
        "freed cached blocks stay hits until allocation pressure evicts them, oldest first",
        ["eviction", "events"],
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=3)
    s.full([1, 2, 1], [1, 2, 3], 0, 3)
    s("free_blocks", block_ids=[3, 2, 1])
    s("get_cached_block", block_hash="0102", kv_cache_group_ids=[0])
    s("touch", block_ids=[1, 2])
    s("get_new_blocks", num_blocks=2)
    s("get_cached_block", block_hash="010201", kv_cache_group_ids=[0])
    s("free_blocks", block_ids=[2, 1])
    s("get_new_blocks", num_blocks=4)
    s("take_events")
    yield s

    s = Script(
        "eviction/evict-keeps-position",
        "evict_blocks drops hashes only: a free block keeps its place, a held block stays held",
        ["eviction"],
        num_blocks=8,
    )
    s("get_new_blocks", num_blocks=4)
    s.full([1, 1, 1, 1], [1, 2, 3, 4], 0, 4)
    s("free_blocks", block_ids=[1, 2])
    s("evict_blocks", block_ids=[2, 4])
    s("evict_blocks", block_ids=[])
    s("free_blocks", block_ids=[3, 4])
    s("get_new_blocks", num_blocks=7)
    yield s


@scenario
def reset() -> Iterator[Script]:
    for caching in (True, False):
        s = Script(
            f"reset/refused-then-done/{'caching' if caching else 'no-caching'}",
            "reset_prefix_cache is refused while any block is held, and clears the map "
            "(keeping the queue) once all are free",
            ["reset", "events", "caching" if caching else "caching-off"],
            num_blocks=4,
            enable_caching=caching,
            enable_events=True,
        )
        s("get_new_blocks", num_blocks=2)
        if caching:
            s.full([2, 1], [1, 2], 0, 2)
        s("reset_prefix_cache")
        s("free_blocks", block_ids=[1])
        s("reset_prefix_cache")
        s("free_blocks", block_ids=[2])
        s("reset_prefix_cache")
        s("get_cached_block", block_hash="02", kv_cache_group_ids=[0])
        s("take_events")
        s("reset_prefix_cache")
        s("take_events")
        yield s


@scenario
def events() -> Iterator[Script]:
    s = Script(
        "events/block-stored-fields",
        "BlockStored: parent hash, token ids, masked and null blocks, lora",
        ["events"],
        num_blocks=6,
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=4)
    lora = {**req([1, 2, 2, 1]), "lora_id": 7, "lora_name": "adapter"}
    s.full([], [1, 0, 2, 3], 1, 4, group=2, mask=[True, False, True], request=lora)
    s.full([], [1, 2], 0, 1, mask=[False], request=lora)
    s.full([], [1, 2], 2, 1, request=lora)
    s("take_events")
    s("take_events")
    yield s

    s = Script(
        "events/disabled", "with events disabled nothing is queued", ["events"], num_blocks=3
    )
    s("get_new_blocks", num_blocks=1)
    s.full([1], [1], 0, 1)
    s("take_events")
    yield s


@scenario
def caching_off() -> Iterator[Script]:
    s = Script(
        "caching-off/queries",
        "without prefix caching lookups miss and caching calls are rejected",
        ["caching-off", "rejections"],
        num_blocks=4,
        enable_caching=False,
        enable_events=True,
    )
    s("get_new_blocks", num_blocks=2)
    s.full([1, 2], [1, 2], 0, 2)
    s.partial([1, 2], block_id=1, num_tokens=1, block_size=2)
    s("get_cached_block", block_hash="01", kv_cache_group_ids=[0])
    s("evict_blocks", block_ids=[1, 3])
    s("free_blocks", block_ids=[1, 2])
    s("take_events")
    yield s


@scenario
def rejections() -> Iterator[Script]:
    """Level 2: every precondition, each rejected with the state left as it was."""
    s = Script(
        "rejections/counts-and-ids",
        "bad counts, unknown ids, frees of free blocks",
        ["rejections"],
        num_blocks=4,
    )
    s("get_new_blocks", num_blocks=-1)
    s("get_new_blocks", num_blocks=4)
    s("get_new_blocks", num_blocks=2)
    s("touch", block_ids=[1, 4])
    s("touch", block_ids=[-1])
    s("free_blocks", block_ids=[3])
    s("free_blocks", block_ids=[1, 1])
    s("free_blocks", block_ids=[1, 9])
    s("evict_blocks", block_ids=[-2, 1])
    s("evict_blocks", block_ids=[4])
    s("get_cached_block", block_hash="01", kv_cache_group_ids=[0, -1])
    yield s

    s = Script(
        "rejections/cache-full-blocks",
        "every way cache_full_blocks can be misused",
        ["rejections"],
        num_blocks=6,
        hash_block_size=2,
    )
    s("get_new_blocks", num_blocks=3)
    tokens = [1, 1, 2, 2, 1, 1]
    s.full(tokens, [1, 2], 0, 2, block_size=3)
    s.full(tokens, [1, 2], 0, 2, block_size=0)
    s.full(tokens, [1, 2], 0, 3, block_size=2)
    s.full(tokens, [1, 2], -1, 2, block_size=2)
    s.full(tokens, [1, 2], 0, 2, block_size=2, mask=[True])
    s.full(tokens, [1, 2], 0, 2, block_size=4)
    s.full(tokens, [1, 1], 0, 2, block_size=2)
    s.full(tokens, [1, 4], 0, 2, block_size=2)
    s.full(tokens, [1, 7], 0, 2, block_size=2)
    s.full(tokens, [1, 2], 0, 2, block_size=2, group=-1)
    s.full(tokens, [1, 2], 0, 2, block_size=2)
    s.full(tokens, [3, 2], 0, 2, block_size=2)
    s.full(tokens, [1, 2], 2, 2, block_size=2)
    yield s

    s = Script(
        "rejections/cache-partial-block",
        "every way cache_partial_block can be misused",
        ["rejections", "partial-blocks"],
        num_blocks=4,
        hash_block_size=2,
    )
    s("get_new_blocks", num_blocks=1)
    tokens = [1, 1, 2, 2, 1, 1]
    s.partial(tokens, block_id=1, num_tokens=2, block_size=2)
    s.partial(tokens, block_id=1, num_tokens=2, block_size=3)
    s.partial(tokens, block_id=1, num_tokens=3, block_size=4)
    s.partial(tokens, block_id=1, num_tokens=4, block_size=4)
    s.partial(tokens, block_id=1, num_tokens=0, block_size=4)
    s.partial(tokens, block_id=1, num_tokens=10, block_size=4)
    s.partial(tokens, block_id=2, num_tokens=2, block_size=4)
    s.partial(tokens, block_id=5, num_tokens=2, block_size=4)
    s.partial(tokens, block_id=1, num_tokens=2, block_size=4, group=-3)
    s.partial(tokens, block_id=1, num_tokens=6, block_size=4)
    yield s

    s = Script(
        "rejections/precedence",
        "when several preconditions fail, the model's order of checks names the rejection: "
        "caching, then group, then block ids",
        ["rejections", "caching-off"],
        num_blocks=3,
        enable_caching=False,
    )
    s("get_new_blocks", num_blocks=1)
    s.full([1], [7], 0, 1, group=-1)
    s.partial([1], block_id=-1, num_tokens=1, block_size=2, group=-1)
    yield s

    s = Script(
        "rejections/precedence/caching",
        "with caching on, a bad group id is named before an unknown block",
        ["rejections"],
        num_blocks=3,
    )
    s.full([1], [7], 0, 1, group=-1)
    s.partial([1], block_id=9, num_tokens=1, block_size=2, group=-2)
    s.partial([1], block_id=9, num_tokens=1, block_size=2)
    yield s


# --------------------------------------------------------------------------
# The corpus: random walks over the model
# --------------------------------------------------------------------------

WALK_SEED = 20240501
WALKS_PER_SETTING = 4


def _tokens(rng: random.Random) -> list[int]:
    return [rng.randint(1, 2) for _ in range(rng.randint(2, 10))]


def _draw(
    rng: random.Random, s: Script, held: list[int], level: int
) -> tuple[str, dict[str, Json]]:
    """One operation, drawn the way the lock-step machine draws them."""
    config = s.config
    n, hbs = config.num_blocks, config.hash_block_size
    any_ids = list(range(n))
    if level >= 2 and rng.random() < 0.2:
        any_ids += [-1, n, 1000]
    pick_held = held or any_ids
    op = rng.choices(
        [
            "get_new_blocks",
            "touch",
            "free_blocks",
            "cache_full_blocks",
            "cache_partial_block",
            "get_cached_block",
            "evict_blocks",
            "reset_prefix_cache",
            "take_events",
            "get_num_free_blocks",
            "get_usage",
        ],
        weights=[6, 3, 6, 5, 3, 3, 2, 1, 2, 1, 1],
    )[0]
    if op == "get_new_blocks":
        return op, {"num_blocks": rng.randint(-1 if level >= 2 else 0, 3)}
    if op == "touch":
        return op, {"block_ids": [rng.choice(any_ids) for _ in range(rng.randint(1, 3))]}
    if op == "free_blocks":
        source = any_ids if level >= 2 and rng.random() < 0.2 else pick_held
        return op, {"block_ids": rng.sample(source, min(len(source), rng.randint(0, 3)))}
    if op == "cache_full_blocks":
        source = any_ids if level >= 2 and rng.random() < 0.3 else pick_held
        ids = rng.sample(source, min(len(source), rng.randint(1, 4)))
        cached, full = rng.randint(0, 2), rng.randint(1, 4)
        mask = None
        if rng.random() < 0.3:
            mask = [rng.random() < 0.5 for _ in range(max(0, full - cached))]
        return op, {
            "request": req(_tokens(rng), hbs),
            "block_ids": ids,
            "num_cached_blocks": cached,
            "num_full_blocks": full,
            "block_size": hbs * rng.randint(1, 2),
            "kv_cache_group_id": rng.randint(0, 1),
            "block_mask": mask,
        }
    if op == "cache_partial_block":
        return op, {
            "request": req(_tokens(rng), hbs),
            "block_id": rng.choice(pick_held),
            "num_tokens": rng.randint(1, 6),
            "kv_cache_group_id": rng.randint(0, 1),
            "block_size": hbs * rng.randint(2, 4),
        }
    if op == "get_cached_block":
        tokens = _tokens(rng)
        return op, {
            "block_hash": protocol.encode_hash(bytes(tokens[: rng.randint(1, 4) * hbs])),
            "kv_cache_group_ids": sorted(rng.sample([0, 1], rng.randint(0, 2))),
        }
    if op == "evict_blocks":
        return op, {"block_ids": sorted({rng.choice(any_ids) for _ in range(rng.randint(0, 2))})}
    return op, {}


def random_walk(
    seed: int, level: int, profile: str, caching: bool, steps: int = 24
) -> dict[str, Json]:
    """One random walk over the model; the same arguments always give the same vector."""
    rng = random.Random(seed)
    s = Script(
        f"walk/level{level}/{profile}/{'caching' if caching else 'no-caching'}/{seed}",
        f"random walk, seed {seed}",
        ["random-walk", f"profile:{profile}", "caching" if caching else "caching-off"],
        num_blocks=rng.randint(2, 7),
        enable_caching=caching,
        hash_block_size=rng.choice([1, 1, 2]),
        enable_events=rng.random() < 0.5,
        profile=profile,
    )
    held: list[int] = []
    while len(s.steps) < steps:
        op, args = _draw(rng, s, held, level)
        if level < 2 and not s.accepts(op, **args):
            continue
        result = s(op, **args)
        if "error" in s.steps[-1]["expect"]:
            continue
        if op == "get_new_blocks":
            held.extend(result)
        elif op == "touch":
            held.extend(b for b in args["block_ids"] if b != 0)
        elif op == "free_blocks":
            for b in args["block_ids"]:
                if b in held:
                    held.remove(b)
    return s.vector()


def generate() -> dict[str, list[dict[str, Json]]]:
    """The whole corpus, file name to vectors. Deterministic: no clock, no Hypothesis."""
    scenarios = [script.vector() for make in SCENARIOS for script in make()]
    walks: dict[int, list[dict[str, Json]]] = {1: [], 2: []}
    seed = WALK_SEED
    for level in (1, 2):
        for profile in PROFILES:
            for caching in (True, False):
                for _ in range(WALKS_PER_SETTING):
                    seed += 1
                    walks[level].append(random_walk(seed, level, profile, caching))
    return {
        "scenarios.jsonl": scenarios,
        "walks-level1.jsonl": walks[1],
        "walks-level2.jsonl": walks[2],
    }


def dump_line(vector: dict[str, Json]) -> str:
    """A vector as one line of a .jsonl file (compact, keys in a fixed order)."""
    return json.dumps(vector, separators=(",", ":"))


def export(directory: Path) -> dict[str, Json]:
    """Write the corpus and its manifest into ``directory``; return the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    total = 0
    for name, vectors in generate().items():
        data = "".join(dump_line(v) + "\n" for v in vectors).encode()
        (directory / name).write_bytes(data)
        files.append({"name": name, "count": len(vectors), "sha256": _sha256(data)})
        total += len(vectors)
    manifest: dict[str, Json] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "generator_version": GENERATOR_VERSION,
        "count": total,
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def bundled_corpus() -> Path:
    """The corpus shipped inside the kvpool package."""
    return Path(str(resources.files("kvpool.specs").joinpath("vectors")))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------
# Reading vectors: untrusted data, parsed with json and checked by the schema
# --------------------------------------------------------------------------


class VectorFormatError(ValueError):
    """Vectors or a manifest that do not follow the format; the message names file and line."""


@dataclass(frozen=True)
class LoadedVector:
    """A vector read from ``source`` (file name) at ``line`` (1-based)."""

    source: str
    line: int
    data: dict[str, Json]

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def load_schema(name: str) -> dict[str, Json]:
    text = resources.files("kvpool.specs").joinpath("schemas", name).read_text()
    schema: dict[str, Json] = json.loads(text)
    return schema


def validators() -> tuple[Any, Any]:
    """JSON Schema validators for one vector and for a manifest."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    protocol_schema = load_schema("protocol-v1.json")
    vectors_schema = load_schema("vectors-v1.json")
    registry: Registry[Any] = Registry().with_resources(
        [
            (protocol_schema["$id"], Resource.from_contents(protocol_schema)),
            (vectors_schema["$id"], Resource.from_contents(vectors_schema)),
        ]
    )
    vector = Draft202012Validator(vectors_schema, registry=registry)
    manifest = Draft202012Validator(
        {"$defs": vectors_schema["$defs"], "$ref": "#/$defs/manifest"}, registry=registry
    )
    return vector, manifest


def _schema_errors(validator: Any, value: Json, where: str) -> list[str]:
    problems = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        problems.append(f"{where}: field {path}: {_short(error.message)}")
    return problems


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:297] + "..."


def load(path: Path, max_errors: int = 20) -> list[LoadedVector]:
    """Read and validate vectors from a directory with a manifest, or from one .jsonl file.

    Raises VectorFormatError listing every problem (file, line and field).
    """
    validator, manifest_validator = validators()
    problems: list[str] = []
    if path.is_dir():
        files = _manifest_files(path, manifest_validator, problems)
    elif path.is_file():
        files = [(path, None)]
    else:
        raise VectorFormatError(f"{path}: no such file or directory")
    loaded: list[LoadedVector] = []
    for file, count in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            problems.append(f"{file.name}: cannot read: {error}")
            continue
        lines = text.splitlines()
        if count is not None and count != sum(1 for x in lines if x.strip()):
            problems.append(
                f"{file.name}: the manifest says {count} vectors, the file has "
                f"{sum(1 for x in lines if x.strip())}"
            )
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file.name} line {number}"
            try:
                value = json.loads(line)
            except ValueError as error:
                problems.append(f"{where}: not JSON: {error}")
                continue
            errors = _schema_errors(validator, value, where)
            if errors:
                problems.extend(errors)
            else:
                loaded.append(LoadedVector(file.name, number, value))
        if len(problems) >= max_errors:
            break
    if problems:
        shown = problems[:max_errors]
        more = len(problems) - len(shown)
        raise VectorFormatError(
            "\n".join(shown) + (f"\n... and {more} more problem(s)" if more > 0 else "")
        )
    return loaded


def _manifest_files(
    directory: Path, validator: Any, problems: list[str]
) -> list[tuple[Path, int | None]]:
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise VectorFormatError(
            f"{manifest_path}: missing (a vectors directory needs one)"
        ) from None
    except (OSError, ValueError) as error:
        raise VectorFormatError(f"{manifest_path}: not a JSON manifest: {error}") from error
    errors = _schema_errors(validator, manifest, MANIFEST)
    if errors:
        raise VectorFormatError("\n".join(errors))
    files: list[tuple[Path, int | None]] = []
    for entry in manifest["files"]:
        file = directory / entry["name"]
        try:
            data = file.read_bytes()
        except OSError as error:
            problems.append(f"{MANIFEST}: lists {entry['name']}, which cannot be read: {error}")
            continue
        if _sha256(data) != entry["sha256"]:
            problems.append(
                f"{entry['name']}: sha256 {_sha256(data)} does not match the "
                f"manifest's {entry['sha256']}"
            )
            continue
        files.append((file, int(entry["count"])))
    if sum(entry["count"] for entry in manifest["files"]) != manifest["count"]:
        problems.append(
            f"{MANIFEST}: count {manifest['count']} is not the sum of the files' counts"
        )
    return files


# --------------------------------------------------------------------------
# Replaying vectors against a target
# --------------------------------------------------------------------------


@dataclass
class Mismatch:
    """Where a target parts from a vector."""

    vector: str
    where: str
    step: int
    """1-based; 0 when the pool could not even be built."""
    op: str
    args: dict[str, Json]
    problem: str
    diff: str | None = None

    def describe(self) -> str:
        head = (
            f"{self.where} {self.vector}: step {self.step}, "
            f"{self.op} {json.dumps(self.args, separators=(', ', ': '))}: {self.problem}"
        )
        return head if self.diff is None else f"{head}\n{self.diff}"


def same_result(op: str, expected: Json, actual: Json, target: object = None) -> bool:
    """Whether a target's JSON result counts as the model's (usage within 1e-9)."""
    if op == "get_usage":
        return (
            isinstance(actual, int | float)
            and not isinstance(actual, bool)
            and math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-9)
        )
    if op == "take_events":
        return bool(_normal_events(target, expected) == _normal_events(target, actual))
    return bool(expected == actual)


def _normal_events(target: object, events: Json) -> Json:
    normalize = getattr(target, "normalize_events", None)
    if normalize is None or not isinstance(events, list):
        return events
    try:
        decoded = [protocol.decode_event(e) for e in events]
    except protocol.ProtocolError:
        return events
    return [protocol.encode_event(e) for e in normalize(decoded)]


def state_of(target: object, config: PoolConfig) -> Json | None:
    """The target's state in canonical JSON (normalized), or None if it has no snapshot."""
    if not isinstance(target, Snapshottable):
        return None
    return normal_state(target, protocol.encode_state(target.snapshot()), config)


def normal_state(target: object, state: Json, config: PoolConfig) -> Json:
    """``state`` after the target's ``normalize_state`` hook, if it has one."""
    normalize = getattr(target, "normalize_state", None)
    if normalize is None:
        return state
    return protocol.encode_state(normalize(protocol.decode_state(state, config)))


def check_step(target: PoolTarget, step: dict[str, Json]) -> str | None:
    """Run one step on ``target``; None if it matches, else what went wrong."""
    op, args, expect = step["op"], step["args"], step["expect"]
    try:
        actual = protocol.apply(target, op, args)
    except PoolError as rejection:
        name = type(rejection).__name__
        if "error" not in expect:
            return (
                f"the model accepts it (returning {expect['ok']!r}), "
                f"the target rejects it with {name}: {rejection}"
            )
        if name != expect["error"]:
            return f"the model rejects it with {expect['error']}, the target with {name}"
        actual = None
    else:
        if "error" in expect:
            return (
                f"the model rejects it with {expect['error']}, "
                f"the target accepts it (returning {actual!r})"
            )
        if not same_result(op, expect["ok"], actual, target):
            return f"the model returns {expect['ok']!r}, the target returned {actual!r}"
    return None


def state_problem(target: PoolTarget, config: PoolConfig, expected: Json) -> tuple[str, str] | None:
    """(problem, side-by-side diff) if the target's state is not ``expected``."""
    actual = state_of(target, config)
    if actual is None:
        return None
    wanted = normal_state(target, expected, config)
    if actual == wanted:
        return None
    from kvpool.specs.machine import state_diff

    diff = state_diff(protocol.decode_state(wanted, config), protocol.decode_state(actual, config))
    return "the target's state differs from the model's", diff


def run_vector(factory: TargetFactory, vector: LoadedVector) -> Mismatch | None:
    """Replay one vector; None if the target matches it at every step.

    Results are compared at every step; the whole state too when the target
    has ``snapshot()``. TargetError propagates.
    """
    data = vector.data
    config = protocol.decode_config(data["config"])
    vid = str(data["id"])
    try:
        target = factory(config)
    except PoolError as error:
        return Mismatch(
            vid,
            vector.where,
            0,
            "new_pool",
            data["config"],
            f"the target cannot build the pool: {type(error).__name__}: {error}",
        )
    except TargetError:
        raise
    except Exception as error:  # the target's own bug: a target error, not a kit crash
        from kvpool.specs.regression import crash_message

        raise TargetError(crash_message("new_pool", data["config"], error)) from error
    for number, step in enumerate(data["steps"], 1):
        try:
            problem = check_step(target, step)
            state = None if problem is not None else state_problem(target, config, step["state"])
        except TargetError:
            raise
        except Exception as error:  # the target's own bug: a target error, not a kit crash
            from kvpool.specs.regression import crash_message

            raise TargetError(crash_message(step["op"], step["args"], error)) from error
        if problem is not None:
            return Mismatch(vid, vector.where, number, step["op"], step["args"], problem)
        if state is not None:
            return Mismatch(vid, vector.where, number, step["op"], step["args"], *state)
    return None


@dataclass
class RunResult:
    """The outcome of replaying a corpus."""

    run: int = 0
    passed: int = 0
    skipped: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    target_error: str | None = None


def run_corpus(
    factory: TargetFactory,
    vectors: Sequence[LoadedVector],
    levels: Sequence[int] | None = None,
    profiles: Sequence[str] | None = None,
    fail_fast: bool = False,
) -> RunResult:
    """Replay every vector whose level and profile are chosen; count what happened."""
    result = RunResult()
    for vector in vectors:
        config = vector.data["config"]
        if (levels is not None and vector.data["level"] not in levels) or (
            profiles is not None and config["profile"] not in profiles
        ):
            result.skipped += 1
            continue
        result.run += 1
        try:
            mismatch = run_vector(factory, vector)
        except TargetError as error:
            result.target_error = f"{vector.where} {vector.data['id']}: {error}"
            break
        except TargetAbort as abort:
            result.target_error = f"{vector.where} {vector.data['id']}: {abort.error}"
            break

        if mismatch is None:
            result.passed += 1
        else:
            result.mismatches.append(mismatch)
            if fail_fast:
                break
    return result


# --------------------------------------------------------------------------
# The ``kvpool vectors`` command
# --------------------------------------------------------------------------

vectors_app = typer.Typer(
    help="Conformance vectors: export the model's corpus, replay it against a target.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


@vectors_app.command("export")
def export_command(
    directory: Annotated[
        Path, typer.Argument(help="Where to write the .jsonl files and manifest.")
    ],
) -> None:
    """Write the model's corpus (JSON lines and manifest.json) into DIRECTORY."""
    manifest = export(directory)
    Console().print(
        f"wrote {manifest['count']} vectors in {len(manifest['files'])} files to {directory}"
    )


@vectors_app.command("validate")
def validate_command(
    path: Annotated[Path, typer.Argument(help="A vectors directory (with manifest) or a .jsonl.")],
) -> None:
    """Check vectors against the schema and the manifest, without running anything."""
    console = Console()
    try:
        loaded = load(path)
    except VectorFormatError as error:
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    console.print(f"{len(loaded)} valid vectors in {path}")


@vectors_app.command("run")
def run_command(
    path: Annotated[
        Path | None,
        typer.Argument(help="A vectors directory (with manifest) or a .jsonl; default: bundled."),
    ] = None,
    target: Annotated[
        str, typer.Option(help="impl, model, cmd:PROGRAM ARGS, or module:factory.")
    ] = "impl",
    level: Annotated[
        list[int] | None, typer.Option(help="Run only vectors of this level (repeatable).")
    ] = None,
    profile: Annotated[
        list[str] | None, typer.Option(help="Run only vectors of this profile (repeatable).")
    ] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop at the first mismatch.")] = False,
) -> None:
    """Replay vectors against a target. Exit 0: all match; 1: a mismatch; 2: cannot run."""
    from kvpool.specs.targets import TargetSpecError, resolve_target

    console = Console()
    source = path or bundled_corpus()
    try:
        vectors = load(source)
        factory = resolve_target(target)
        levels, profiles = _supported(factory, level, profile)
    except VectorFormatError as error:
        console.print(f"[red]invalid vectors[/red] in {source}:")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    except (TargetSpecError, TargetError, TargetAbort) as error:
        console.print(f"[red]cannot run target {target!r}:[/red]")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    result = run_corpus(factory, vectors, levels, profiles, fail_fast)
    close = getattr(factory, "close", None)
    if close is not None:
        close()
    for mismatch in result.mismatches[:10]:
        console.rule(f"[red]{mismatch.vector}[/red]")
        console.print(mismatch.describe(), markup=False, highlight=False)
    if len(result.mismatches) > 10:
        console.print(f"... and {len(result.mismatches) - 10} more mismatching vectors")
    if result.target_error is not None:
        console.rule("[red]target error[/red]")
        console.print(result.target_error, markup=False, highlight=False)
    failed = len(result.mismatches)
    console.print(
        f"{target}: {result.passed} passed, {failed} failed, {result.skipped} skipped "
        f"({result.run} run from {source})"
    )
    if result.target_error is not None:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_MISMATCH if failed else EXIT_OK)


def _supported(
    factory: TargetFactory, level: list[int] | None, profile: list[str] | None
) -> tuple[list[int] | None, list[str] | None]:
    """The levels and profiles to run: the options, within what the target declares."""
    declared_levels = getattr(factory, "levels", None)
    declared_profiles = getattr(factory, "profiles", None)
    levels = list(level) if level else None
    profiles = list(profile) if profile else None
    if declared_levels is not None:
        levels = [x for x in (levels or declared_levels) if x in declared_levels]
    if declared_profiles is not None:
        profiles = [p for p in (profiles or declared_profiles) if p in declared_profiles]
    return levels, profiles
