"""Built-in scenarios: short operation sequences that teach how a v1 block pool behaves.

A scenario is data: a pool configuration and a list of steps, each an
operation name, its arguments (the JSON arguments of the target protocol,
docs/formats.md) and one sentence of narration. ``run`` applies the steps to
``kvpool.model`` and yields, for each, the state after it and the result. The
same steps are a conformance vector's steps, so ``load`` reads a vector file
(``.jsonl``, one vector per line, ``kvpool.specs.vectors.load``) and ``kvpool
explain`` tells either kind of story.

Requests use readable hashes: the hash of block i of the request ``"ABC"`` is
its first i+1 letters (``A``, ``AB``, ``ABC``), an injective chained hash, so a
picture shows which prefix each cached block holds.

>>> outcome = list(run(get("hashless-first")))[-1]
>>> outcome.result, outcome.state.free_queue
([6, 5, 4, 3], (7, 2, 1))
"""

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvpool import model
from kvpool.model import PROFILES, KVCacheEvent, PoolConfig, PoolError, PoolState
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json


@dataclass(frozen=True)
class Step:
    """One operation: its name in ``kvpool.model``, its protocol arguments, a sentence."""

    op: str
    args: Mapping[str, Json]
    say: str = ""


@dataclass(frozen=True)
class Scenario:
    """A named story: a pool configuration and the steps played on it."""

    name: str
    title: str
    config: PoolConfig
    steps: tuple[Step, ...]
    summary: str = ""
    expected: tuple[Mapping[str, Json] | None, ...] = ()
    """For scenarios read from a vector: each step's recorded ``expect`` (or None)."""

    def with_profile(self, profile: str) -> "Scenario":
        """The same steps on a pool with another semantics profile."""
        return replace(
            self,
            name=f"{self.name}@{profile}",
            config=replace(self.config, profile=PROFILES[profile]),
        )


@dataclass(frozen=True)
class Outcome:
    """What one step did: the states around it, its result and the events it emitted."""

    index: int
    """1-based position of the step in its scenario."""
    step: Step
    before: PoolState
    state: PoolState
    """The state after the step (the state before it if the step was rejected)."""
    result: Json
    """The protocol (JSON) result; None for a rejected step."""
    error: str | None
    """The rejection's class name (``kvpool.model.errors``), or None."""
    events: tuple[KVCacheEvent, ...]
    """Events the step queued (with events enabled)."""
    mismatch: str | None = None
    """For a step read from a vector: how the model's answer differs from the recorded one."""

    @property
    def changed(self) -> frozenset[int]:
        """Blocks the step changed: their ref count or keys, or in or out of the free queue.

        A block that stayed free but moved because others were added or
        removed around it does not count.
        """
        was_free, now_free = set(self.before.free_queue), set(self.state.free_queue)
        return frozenset(
            block_id
            for block_id in range(self.state.config.num_blocks)
            if self.before.blocks[block_id] != self.state.blocks[block_id]
            or (block_id in was_free) != (block_id in now_free)
        )


class ScenarioError(ValueError):
    """A scenario name or file that cannot be read; the message says why."""


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def run(scenario: Scenario) -> Iterator[Outcome]:
    """Apply the steps to ``kvpool.model``, one ``Outcome`` per step.

    A step the model rejects leaves the state as it was and reports the
    rejection; the run goes on (vectors at level 2 contain such steps).
    """
    pool = ModelTarget(scenario.config)
    for index, step in enumerate(scenario.steps, 1):
        before = pool.state
        result: Json = None
        error: str | None = None
        try:
            result = protocol.apply(pool, step.op, step.args)
        except PoolError as rejection:
            error = type(rejection).__name__
            pool.state = before
        after = pool.state
        events = after.pending_events[len(before.pending_events) :]
        if step.op == "take_events":
            events = ()
        mismatch = None
        if index <= len(scenario.expected):
            mismatch = _compare(step.op, scenario.expected[index - 1], result, error)
        yield Outcome(index, step, before, after, result, error, tuple(events), mismatch)


def initial_state(scenario: Scenario) -> PoolState:
    """The empty pool the scenario starts from."""
    return ModelTarget(scenario.config).state


def final_state(scenario: Scenario) -> PoolState:
    """The state after the last step."""
    state = initial_state(scenario)
    for outcome in run(scenario):
        state = outcome.state
    return state


def _compare(
    op: str, expected: Mapping[str, Json] | None, result: Json, error: str | None
) -> str | None:
    if expected is None:
        return None
    if "error" in expected:
        if error == expected["error"]:
            return None
        got = f"rejects it with {error}" if error else f"returns {result!r}"
        return f"the vector expects {expected['error']}; the model now {got}"
    if error is not None:
        return f"the vector expects {expected.get('ok')!r}; the model now rejects it with {error}"
    from kvpool.specs.vectors import same_result

    if same_result(op, expected.get("ok"), result):
        return None
    return f"the vector expects {expected.get('ok')!r}; the model now returns {result!r}"


# --------------------------------------------------------------------------
# Building scenarios
# --------------------------------------------------------------------------


def request(text: str, hash_block_size: int = 1) -> dict[str, Json]:
    """A request's protocol JSON for the tokens ``text``, one letter per token.

    The hash of hash block i is the text of the first (i+1)*hash_block_size
    letters, so the hashes read as the prefixes they stand for.

    >>> [bytes.fromhex(h) for h in request("ABC")["block_hashes"]]
    [b'A', b'AB', b'ABC']
    >>> [bytes.fromhex(h) for h in request("ABCD", 2)["block_hashes"]]
    [b'AB', b'ABCD']
    """
    n = len(text) // hash_block_size
    hashes = [text[: (i + 1) * hash_block_size].encode().hex() for i in range(n)]
    return {
        "block_hashes": hashes,
        "all_token_ids": [ord(c) for c in text],
        "lora_id": None,
        "lora_name": None,
    }


def _hash(text: str) -> str:
    return text.encode().hex()


def new_blocks(n: int, say: str) -> Step:
    return Step("get_new_blocks", {"num_blocks": n}, say)


def touch(ids: Sequence[int], say: str) -> Step:
    return Step("touch", {"block_ids": list(ids)}, say)


def free(ids: Sequence[int], say: str) -> Step:
    return Step("free_blocks", {"block_ids": list(ids)}, say)


def evict(ids: Sequence[int], say: str) -> Step:
    return Step("evict_blocks", {"block_ids": sorted(ids)}, say)


def lookup(prefix: str, say: str, groups: Sequence[int] = (0,)) -> Step:
    args = {"block_hash": _hash(prefix), "kv_cache_group_ids": list(groups)}
    return Step("get_cached_block", args, say)


def cache_full(
    text: str,
    ids: Sequence[int],
    num_cached: int,
    num_full: int,
    say: str,
    block_size: int = 1,
    hash_block_size: int = 1,
    group: int = 0,
) -> Step:
    args = {
        "request": request(text, hash_block_size),
        "block_ids": list(ids),
        "num_cached_blocks": num_cached,
        "num_full_blocks": num_full,
        "block_size": block_size,
        "kv_cache_group_id": group,
        "block_mask": None,
    }
    return Step("cache_full_blocks", args, say)


def cache_partial(
    text: str,
    block_id: int,
    num_tokens: int,
    block_size: int,
    hash_block_size: int,
    say: str,
    group: int = 0,
) -> Step:
    args = {
        "request": request(text, hash_block_size),
        "block_id": block_id,
        "num_tokens": num_tokens,
        "kv_cache_group_id": group,
        "block_size": block_size,
    }
    return Step("cache_partial_block", args, say)


def reset(say: str) -> Step:
    return Step("reset_prefix_cache", {}, say)


def take_events(say: str) -> Step:
    return Step("take_events", {}, say)


def _config(
    num_blocks: int,
    profile: str = model.DEFAULT_PROFILE.name,
    hash_block_size: int = 1,
    enable_events: bool = False,
) -> PoolConfig:
    return PoolConfig(
        num_blocks,
        enable_caching=True,
        hash_block_size=hash_block_size,
        enable_events=enable_events,
        profile=PROFILES[profile],
    )


# --------------------------------------------------------------------------
# The built-in scenarios
# --------------------------------------------------------------------------

TUTORIAL = Scenario(
    name="tutorial",
    title="From an empty pool to eviction under pressure",
    summary=(
        "Two requests share the prefix AB, finish, and leave their blocks cached in the "
        "free queue; a third request still hits AB, and an allocation that needs every "
        "free block evicts the cached ABC last of all."
    ),
    config=_config(8),
    steps=(
        new_blocks(
            4,
            "Request 1 (prompt ABC, one more token to come) takes four blocks from the front "
            "of the free queue.",
        ),
        cache_full(
            "ABCD",
            [1, 2, 3, 4],
            0,
            3,
            "Its first three blocks are full, so they are cached under the hashes of the "
            "prefixes A, AB and ABC; block 4 is still being written and has no hash.",
        ),
        lookup(
            "AB",
            "Request 2 starts with the same prefix AB: a lookup finds block 2 (and A finds "
            "block 1). Looking changes nothing.",
        ),
        touch(
            [1, 2],
            "Request 2 shares blocks 1 and 2 instead of computing them again: each is now "
            "held twice.",
        ),
        new_blocks(1, "Request 2 takes one new block for the rest of its prompt."),
        free(
            [4, 3, 2, 1],
            "Request 1 finishes and frees its blocks, last block first. Hash-less block 4 "
            "goes to the front of the queue, cached block 3 to the back; blocks 1 and 2 "
            "stay held by request 2.",
        ),
        free(
            [5, 2, 1],
            "Request 2 finishes. Hash-less block 5 goes to the front; 2 and 1 are cached, "
            "so they go to the back, where they are evicted last.",
        ),
        lookup(
            "AB",
            "Request 3 starts with AB. Block 2 is free, but it still holds AB: a cache hit "
            "on an eviction candidate.",
        ),
        touch(
            [1, 2],
            "Request 3 takes blocks 1 and 2 back out of the free queue, hashes intact.",
        ),
        new_blocks(
            5,
            "Memory pressure: a request needs five blocks, every free one. They go front "
            "first: the freed hash-less blocks, then the never-used ones, then cached block "
            "3, which loses ABC.",
        ),
    ),
)

HIT_ON_EVICTION_CANDIDATE = Scenario(
    name="hit-on-eviction-candidate",
    title="A cache hit on a block that is already free",
    summary=(
        "A freed block keeps its hash while it waits in the free queue. A hit takes it "
        "back out; only get_new_blocks drops the hash, and only when it hands the block out."
    ),
    config=_config(5),
    steps=(
        new_blocks(2, "A request takes two blocks."),
        cache_full("AB", [1, 2], 0, 2, "Both are full and get cached as A and AB."),
        free([2, 1], "The request finishes: both blocks are free and still cached."),
        lookup("AB", "A new request looks up AB and finds block 2, which sits in the free queue."),
        touch([1, 2], "Touching the hit takes blocks 1 and 2 out of the free queue, ref 1 each."),
        new_blocks(2, "Other work takes the two remaining free blocks; nothing cached is lost."),
        lookup("AB", "AB is still a hit: it was never at risk while held."),
    ),
)

DUPLICATES = Scenario(
    name="duplicates",
    title="The same prefix cached twice: first inserted wins",
    summary=(
        "Two requests computed the same prefix at the same time. v1 does not de-duplicate: "
        "both blocks sit under one hash, lookups return the older, and block tables stay "
        "append-only."
    ),
    config=_config(5, enable_events=True),
    steps=(
        new_blocks(1, "Request 1 takes block 1 for its prompt A."),
        new_blocks(1, "Request 2 arrives before request 1 has cached anything and takes block 2."),
        cache_full("A", [1], 0, 1, "Request 1 caches block 1 under A."),
        cache_full(
            "A",
            [2],
            0,
            1,
            "Request 2 caches block 2 under the same A: the map now holds both, oldest first.",
        ),
        lookup("A", "A lookup returns block 1, the first inserted."),
        evict([1], "evict_blocks drops block 1's hash; the block itself stays held."),
        lookup("A", "Now the next oldest, block 2, answers for A."),
        cache_full("A", [1], 0, 1, "Block 1 is cached under A again: it joins at the end."),
        lookup("A", "Block 2 still answers: re-inserting does not jump the line."),
        take_events(
            "The event stream holds one BlockStored per insertion and one BlockRemoved per "
            "removal, so a router counts two copies of A."
        ),
    ),
)

RESET_REFUSED = Scenario(
    name="reset-refused",
    title="reset_prefix_cache is refused while any block is held",
    summary=(
        "Resetting the prefix cache while a request still reads its blocks would strand "
        "their hashes; the pool says no (False) and changes nothing."
    ),
    config=_config(5, enable_events=True),
    steps=(
        new_blocks(2, "A request takes two blocks."),
        cache_full("AB", [1, 2], 0, 2, "They are cached as A and AB."),
        reset("A reset while the request runs is refused: the result is False."),
        free([2, 1], "The request finishes; both blocks are free and still cached."),
        reset(
            "Now the reset succeeds: every hash is dropped, the free queue keeps its order, "
            "and one AllBlocksCleared event is queued."
        ),
        lookup("AB", "AB misses."),
    ),
)

PARTIAL_PROMOTED = Scenario(
    name="partial-promoted",
    title="A partial block is promoted when it fills up",
    summary=(
        "With hashes over 2 tokens and blocks of 4, a block half full can already be "
        "reached by its first hash block (a partial key). When the block fills, its full "
        "hash replaces the partial key."
    ),
    config=_config(4, hash_block_size=2, enable_events=True),
    steps=(
        new_blocks(1, "A request takes block 1 (4 tokens per block, hashes every 2)."),
        cache_partial(
            "AB",
            1,
            2,
            4,
            2,
            "Two tokens in, block 1 is cached under AB, a prefix that ends inside it.",
        ),
        lookup("AB", "Another request with prefix AB can hit the half-full block."),
        cache_full(
            "ABCD",
            [1],
            0,
            1,
            "The block fills up (ABCD) and is cached in full: AB is removed and ABCD "
            "becomes its key (promotion).",
            block_size=4,
            hash_block_size=2,
        ),
        lookup("AB", "AB no longer leads anywhere."),
        take_events("The events show BlockStored AB, BlockRemoved AB, BlockStored ABCD."),
    ),
)

_HASHLESS_STEPS = (
    new_blocks(3, "Request 1 takes three blocks."),
    cache_full("AB", [1, 2, 3], 0, 2, "Blocks 1 and 2 are full and cached; block 3 is not."),
    new_blocks(3, "Request 2 takes three blocks and caches none of them."),
    free([3, 2, 1], "Request 1 finishes and frees its blocks, last first."),
    free([6, 5, 4], "Request 2 finishes and frees its blocks, last first."),
    new_blocks(
        4,
        "Four blocks are needed: they come from the front of the queue, and any cached "
        "block among them loses its hash.",
    ),
)

HASHLESS_FIRST = Scenario(
    name="hashless-first",
    title="Freed hash-less blocks are reused first",
    summary=(
        "A block with no hash can never be a cache hit, so v1 (0.24 and later) puts it at "
        "the front of the free queue and keeps cached blocks at the back for as long as "
        "possible."
    ),
    config=_config(8),
    steps=_HASHLESS_STEPS,
)

HASHLESS_FIRST_UNDER_APPEND = Scenario(
    name="hashless-first-under-append",
    title="The same frees under the append profile (vLLM 0.8 to 0.23)",
    summary=(
        "Under the older append rule every freed block goes to the back in the order given, "
        "so cached blocks 2 and 1 wait ahead of hash-less 6, 5 and 4, and the allocation "
        "evicts A and AB while useless blocks stay."
    ),
    config=_config(8, profile="append"),
    steps=_HASHLESS_STEPS,
)

EVICT_HELD_THEN_FREE = Scenario(
    name="evict-held-then-free",
    title="A held block is evicted, then freed: it goes to the front",
    summary=(
        "evict_blocks drops a block's hashes and moves nothing. A held block stays held; "
        "when it is freed later it carries no hash, so it joins the front of the free "
        "queue and is the next block handed out, while its cached neighbours go to the back."
    ),
    config=_config(6, enable_events=True),
    steps=(
        new_blocks(3, "A request takes blocks 1, 2 and 3."),
        cache_full("ABC", [1, 2, 3], 0, 3, "All three are full and cached as A, AB and ABC."),
        evict(
            [2],
            "evict_blocks drops AB from block 2 while the request still holds it: one "
            "BlockRemoved, and block 2 stays held, in place, with no hash.",
        ),
        lookup("AB", "AB now misses."),
        lookup(
            "ABC",
            "ABC still hits by its hash, though its prefix AB is gone: a prefix search "
            "stops at the AB miss and never reaches it.",
        ),
        free(
            [3, 2, 1],
            "The request finishes, last block first. Block 2 has no hash now, so it goes to "
            "the front; 3 and 1 are cached and go to the back.",
        ),
        new_blocks(1, "The next allocation takes block 2 first; nothing cached is evicted."),
        take_events(
            "The events: one BlockStored for A, AB and ABC, one BlockRemoved for AB; the "
            "free and the allocation of a hash-less block emit nothing."
        ),
    ),
)

DUPLICATES_FREED = Scenario(
    name="duplicates-freed",
    title="Duplicates are freed and evicted one copy at a time",
    summary=(
        "Two copies of one prefix are two blocks under one key. Each copy is freed with "
        "its request and evicted on its own when the free queue reaches it; the key stays "
        "cached while any copy lives, and the oldest remaining copy answers lookups."
    ),
    config=_config(7, enable_events=True),
    steps=(
        new_blocks(2, "Request 1 takes blocks 1 and 2 for its prompt AB."),
        new_blocks(2, "Request 2, scheduled in the same step, takes blocks 3 and 4 for AB too."),
        cache_full("AB", [1, 2], 0, 2, "Request 1 caches A and AB."),
        cache_full("AB", [3, 4], 0, 2, "Request 2 caches the same keys: each now has two blocks."),
        free(
            [2, 1],
            "Request 1 finishes: its cached blocks go to the back of the queue, still cached.",
        ),
        lookup("AB", "A lookup still returns block 2, the first inserted, though it is free."),
        free([4, 3], "Request 2 finishes: its copies go to the back too, behind request 1's."),
        new_blocks(
            3,
            "Three blocks are needed: the never-used 5 and 6, then block 2, whose copy of AB "
            "is evicted (one BlockRemoved). The key AB stays, with block 4.",
        ),
        lookup("AB", "Now block 4, the remaining copy, answers for AB."),
        take_events(
            "The events: two BlockStored, one per cache_full_blocks call, each with A and AB, "
            "and one BlockRemoved AB. A router that counts copies still holds AB once."
        ),
    ),
)

EVENT_TRACE = Scenario(
    name="event-trace",
    title="Which operations emit which events",
    summary=(
        "Only changes to the hash map emit events: BlockStored when blocks are cached, "
        "BlockRemoved when a block loses a key (eviction by allocation or by evict_blocks), "
        "AllBlocksCleared when a reset succeeds. Allocating, touching, freeing and looking "
        "up emit nothing."
    ),
    config=_config(5, enable_events=True),
    steps=(
        new_blocks(2, "A request takes blocks 1 and 2: no event."),
        cache_full("AB", [1, 2], 0, 2, "Both are cached: one BlockStored with A and AB."),
        lookup("AB", "A lookup: no event."),
        touch([1, 2], "A second request shares both blocks: no event."),
        free([2, 1], "The first request finishes; the blocks are still held: no event."),
        free([2, 1], "The second finishes; both blocks are free and cached: still no event."),
        new_blocks(
            3,
            "Three blocks are needed: 3, 4, then block 2, which is reused and loses AB: "
            "one BlockRemoved.",
        ),
        evict([1], "evict_blocks drops A from free block 1: one BlockRemoved."),
        reset("A reset while blocks are held is refused: no event."),
        free([2, 4, 3], "The blocks are freed: no event."),
        reset("The reset succeeds: one AllBlocksCleared."),
        take_events("take_events hands over the four events, oldest first."),
    ),
)

BUILT_IN: dict[str, Scenario] = {
    s.name: s
    for s in (
        TUTORIAL,
        HIT_ON_EVICTION_CANDIDATE,
        DUPLICATES,
        DUPLICATES_FREED,
        EVICT_HELD_THEN_FREE,
        EVENT_TRACE,
        RESET_REFUSED,
        PARTIAL_PROMOTED,
        HASHLESS_FIRST,
        HASHLESS_FIRST_UNDER_APPEND,
    )
}
"""Every built-in scenario by name, the tutorial first."""


# --------------------------------------------------------------------------
# Finding scenarios: built-in names, vector files, bundled vector ids
# --------------------------------------------------------------------------


def get(name: str) -> Scenario:
    """A built-in scenario by name; ScenarioError lists the names if there is none."""
    try:
        return BUILT_IN[name]
    except KeyError:
        raise ScenarioError(
            f"no built-in scenario {name!r}; built-in: {', '.join(BUILT_IN)}"
        ) from None


def from_vector(data: Mapping[str, Json]) -> Scenario:
    """A scenario replaying a conformance vector (docs/formats.md) on the model."""
    raw_steps = data.get("steps", [])
    steps = tuple(Step(str(s["op"]), dict(s.get("args", {}))) for s in raw_steps)
    expected = tuple(s.get("expect") for s in raw_steps)
    try:
        config = protocol.decode_config(data["config"])
    except (KeyError, protocol.ProtocolError) as error:
        raise ScenarioError(f"vector {data.get('id')!r}: bad config: {error}") from error
    return Scenario(
        name=str(data.get("id", "vector")),
        title=str(data.get("description", "")),
        config=config,
        steps=steps,
        expected=expected,
    )


def load(path: Path, vector_id: str | None = None) -> Scenario:
    """The scenario of a vector file (``.jsonl``); ``vector_id`` picks one of several.

    Vectors are read and validated by ``kvpool.specs.vectors.load``. A file
    holding one vector needs no id; a file holding several needs one.
    """
    from kvpool.specs.vectors import VectorFormatError
    from kvpool.specs.vectors import load as load_vectors

    try:
        loaded = load_vectors(path)
    except VectorFormatError as error:
        raise ScenarioError(str(error)) from error
    if not loaded:
        raise ScenarioError(f"{path}: holds no vector")
    if vector_id is None:
        if len(loaded) > 1:
            ids = ", ".join(str(v.data["id"]) for v in loaded[:10])
            more = "" if len(loaded) <= 10 else f" and {len(loaded) - 10} more"
            raise ScenarioError(f"{path} holds {len(loaded)} vectors; pick one: {ids}{more}")
        return from_vector(loaded[0].data)
    for vector in loaded:
        if vector.data["id"] == vector_id:
            return from_vector(vector.data)
    raise ScenarioError(f"{path}: no vector with id {vector_id!r}")


def bundled_vector(vector_id: str) -> Scenario | None:
    """The vector ``vector_id`` of the corpus shipped with kvpool, if there is one."""
    from kvpool.specs.vectors import bundled_corpus

    corpus = bundled_corpus()
    for file in sorted(corpus.glob("*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            if f'"id":"{vector_id}"' in line.replace(" ", ""):
                data = json.loads(line)
                if data.get("id") == vector_id:
                    return from_vector(data)
    return None


def resolve(spec: str, vector_id: str | None = None) -> Scenario:
    """A built-in scenario name, a vector file, or the id of a bundled vector."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    path = Path(spec)
    if path.is_file():
        return load(path, vector_id)
    found = bundled_vector(spec)
    if found is not None:
        return found
    raise ScenarioError(
        f"{spec!r} is not a built-in scenario ({', '.join(BUILT_IN)}), "
        "a vector file, or the id of a bundled vector (kvpool explain --list)"
    )
