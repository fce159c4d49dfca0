"""Writing conformance vectors: the model runs scripted and random programs, and records them.

``generate()`` builds the corpus from the model alone, deterministically:
hand-written scenarios for the tricky cases, then random walks driven by
``random.Random(seed)``. The committed copy lives in ``specs/vectors/data/``
(JSON lines plus ``manifest.json``)::

    kvpool vectors export DIR                 # write the corpus
"""

import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvpool import model
from kvpool.model import PROFILES, PoolConfig, PoolError
from kvpool.model.profiles import profile_named
from kvpool.specs.pool.machine import request_for
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json
from kvpool.specs.vectors.format import (
    FORMAT,
    FORMAT_VERSION,
    GENERATOR,
    GENERATOR_VERSION,
    MANIFEST,
    sha256,
)

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
            num_blocks, enable_caching, hash_block_size, enable_events, profile_named(profile)
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
        files.append({"name": name, "count": len(vectors), "sha256": sha256(data)})
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
