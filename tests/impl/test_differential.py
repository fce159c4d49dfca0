"""kvpool.impl against kvpool.model, side by side on random operation sequences.

Each step applies one operation to both, then compares the result (block
ids), the exception type, the whole state (``impl.snapshot()`` against the
model state), and checks the impl's structural invariants. This is the
impl's quick self-check; the official lock-step machine lives in kvpool.specs.
"""

from collections.abc import Callable
from typing import Any, Protocol

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import model
from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import PROFILES, CacheRequest, PoolState
from kvpool.model.profiles import with_event_semantics

HASHES = (b"a", b"b")
"""A tiny alphabet, so different requests share hashes (and blocks share keys)."""


# Protocols rather than Callables: a step's lambda may bind a loop variable through
# a parameter with a default (`lambda s, i=i: ...`), which mypy cannot match to a Callable.
class ModelOp(Protocol):
    def __call__(self, state: PoolState, /) -> tuple[PoolState, Any]: ...


class ImplOp(Protocol):
    def __call__(self, pool: BlockPool, /) -> Any: ...


class Pair:
    """The model state and the impl pool, driven together."""

    def __init__(self, config: model.PoolConfig) -> None:
        self.state: PoolState = model.new_pool(
            config.num_blocks,
            config.enable_caching,
            config.hash_block_size,
            config.enable_events,
            config.profile,
        )
        self.pool = BlockPool(
            config.num_blocks,
            config.enable_caching,
            config.hash_block_size,
            enable_kv_cache_events=config.enable_events,
            profile=config.profile,
        )
        self.foreign: dict[int, KVCacheBlock] = {}
        self.requests: list[CacheRequest] = []
        self.last_partial: tuple[CacheRequest, int, int, int, int] | None = None
        self.compare()

    def block(self, block_id: int) -> KVCacheBlock:
        """The impl's block for an id; an id outside the pool gets a block of no pool."""
        if 0 <= block_id < self.pool.num_gpu_blocks:
            return self.pool.blocks[block_id]
        return self.foreign.setdefault(block_id, KVCacheBlock(block_id))

    def step(
        self,
        model_op: ModelOp,
        impl_op: ImplOp,
        convert: Callable[[Any], Any] = lambda r: r,
    ) -> Any:
        model_error: Exception | None = None
        impl_error: Exception | None = None
        model_result = impl_result = None
        try:
            new_state, model_result = model_op(self.state)
        except model.PoolError as exc:
            model_error = exc
        else:
            self.state = new_state
        try:
            impl_result = convert(impl_op(self.pool))
        except model.PoolError as exc:
            impl_error = exc
        assert type(impl_error) is type(model_error), (impl_error, model_error)
        assert impl_result == model_result, (impl_result, model_result)
        self.compare()
        return model_result

    def compare(self) -> None:
        self.pool.check_invariants()
        assert self.pool.snapshot() == self.state
        assert self.pool.get_num_free_blocks() == model.get_num_free_blocks(self.state)
        assert self.pool.get_usage() == model.get_usage(self.state)


def _ids(blocks: list[KVCacheBlock] | None) -> tuple[int, ...] | None:
    return None if blocks is None else tuple(b.block_id for b in blocks)


@st.composite
def configs(draw: st.DrawFn) -> model.PoolConfig:
    return model.PoolConfig(
        num_blocks=draw(st.integers(2, 9)),
        enable_caching=draw(st.integers(0, 3)) > 0,
        hash_block_size=draw(st.integers(1, 2)),
        enable_events=draw(st.booleans()),
        profile=draw(st.sampled_from(sorted(PROFILES.values(), key=lambda p: p.name))),
    )


@st.composite
def requests(draw: st.DrawFn, hbs: int) -> CacheRequest:
    hashes = tuple(draw(st.lists(st.sampled_from(HASHES), max_size=8)))
    num_tokens = len(hashes) * hbs + draw(st.integers(0, hbs))
    lora = draw(st.sampled_from([(None, None), (3, "adapter")]))
    return CacheRequest(
        block_hashes=hashes,
        all_token_ids=tuple(range(100, 100 + num_tokens)),
        lora_id=lora[0],
        lora_name=lora[1],
    )


def _request(data: st.DataObject, pair: Pair) -> CacheRequest:
    """A fresh request, or (often) one used before, so keys and blocks meet again."""
    if len(pair.requests) > 0 and data.draw(st.booleans()):
        return data.draw(st.sampled_from(pair.requests))
    request = data.draw(requests(pair.state.config.hash_block_size))
    pair.requests.append(request)
    return request


def _held(pair: Pair) -> list[int]:
    return [i for i, b in enumerate(pair.state.blocks) if b.ref_cnt > 0]


def _some_ids(data: st.DataObject, pair: Pair, max_size: int, valid: bool) -> list[int]:
    """Distinct held block ids when ``valid``; else mostly held, sometimes anything."""
    n = pair.state.config.num_blocks
    held = _held(pair)
    if valid:
        return data.draw(st.permutations(held).map(lambda p: p[:max_size]))
    anything = st.integers(-1, n)
    pick = st.sampled_from(held) | anything if held else anything
    return data.draw(st.lists(pick, max_size=max_size))


def _group(data: st.DataObject, groups: int, valid: bool) -> int:
    return data.draw(st.integers(0 if valid else -1, groups - 1))


KINDS = (
    ["get_new_blocks"] * 3
    + ["touch"] * 2
    + ["free"] * 3
    + ["cache_full"] * 4
    + ["cache_partial"] * 4
    + ["get_cached"] * 2
    + ["evict"] * 2
    + ["reset", "take_events"]
)


def run_step(data: st.DataObject, pair: Pair, groups: int) -> None:
    config = pair.state.config
    hbs = config.hash_block_size
    n = config.num_blocks
    kind = data.draw(st.sampled_from(KINDS))
    valid = data.draw(st.integers(0, 5)) > 0
    if kind == "get_new_blocks":
        free = len(pair.state.free_queue)
        count = data.draw(st.integers(0, free) if valid else st.integers(-1, free + 1))
        pair.step(
            lambda s: model.get_new_blocks(s, count),
            lambda p: p.get_new_blocks(count),
            _ids,
        )
    elif kind == "touch":
        ids = data.draw(
            st.lists(st.integers(0 if valid else -1, n - 1 if valid else n), max_size=4)
        )
        pair.step(lambda s: model.touch(s, ids), lambda p: p.touch([pair.block(i) for i in ids]))
    elif kind == "free":
        ids = _some_ids(data, pair, 5, valid)
        if data.draw(st.booleans()):
            ids.insert(data.draw(st.integers(0, len(ids))), 0)  # the null block is skipped
        as_generator = data.draw(st.booleans())

        def impl_free(p: BlockPool) -> None:
            blocks = [pair.block(i) for i in ids]
            p.free_blocks((b for b in blocks) if as_generator else blocks)

        pair.step(lambda s: model.free_blocks(s, ids), impl_free)
    elif kind == "cache_full":
        request = _request(data, pair)
        ids = _some_ids(data, pair, 5, valid)
        extra = data.draw(st.integers(0, 5))
        if extra == 0:
            ids.insert(data.draw(st.integers(0, len(ids))), 0)
        elif extra == 1 and ids:
            ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(ids)))
        factor = data.draw(st.integers(1, 2))
        block_size = hbs * factor
        if not valid:
            block_size += data.draw(st.sampled_from([0, 0, 1]))
        if valid:
            num_cached = data.draw(st.integers(0, len(ids)))
            num_full = data.draw(st.integers(num_cached, len(ids)))
            # Make sure the request hashed that far.
            missing = num_full * factor - len(request.block_hashes)
            if missing > 0:
                request = CacheRequest(
                    request.block_hashes + HASHES[:1] * missing,
                    tuple(range(100, 100 + num_full * block_size)),
                    request.lora_id,
                    request.lora_name,
                )
        else:
            num_cached = data.draw(st.integers(-1, len(ids)))
            num_full = data.draw(st.integers(num_cached - 1, len(ids) + 1))
        mask = None
        if data.draw(st.integers(0, 3)) == 0:
            size = max(0, num_full - num_cached) + (0 if valid else data.draw(st.integers(0, 1)))
            mask = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
        group = _group(data, groups, valid)
        pair.step(
            lambda s: model.cache_full_blocks(
                s, request, ids, num_cached, num_full, block_size, group, mask
            ),
            lambda p: p.cache_full_blocks(
                request,
                [pair.block(i) for i in ids],
                num_cached,
                num_full,
                block_size,
                group,
                mask,
            ),
        )
    elif kind == "cache_partial":
        held = _held(pair)
        if pair.last_partial is not None and data.draw(st.integers(0, 3)) == 0:
            # The same call again, or the same key for another held block.
            request, block_id, num_tokens, group, block_size = pair.last_partial
            if data.draw(st.booleans()) and held:
                block_id = data.draw(st.sampled_from(held))
        else:
            request = _request(data, pair)
            if valid and held and request.block_hashes:
                # Prefer blocks that already carry a key: the partial key then goes beside it.
                hashed = [i for i in held if pair.state.blocks[i].block_hash is not None]
                block_id = data.draw(st.sampled_from(hashed or held) | st.sampled_from(held))
                factor = data.draw(st.integers(2, 3))
                block_size = hbs * factor
                steps = [j for j in range(1, len(request.block_hashes) + 1) if j % factor] or [1]
                covered = pair.state.blocks[block_id].hash_num_tokens
                if covered is not None and data.draw(st.booleans()):
                    # A prefix the block's primary key already covers: a key beside it.
                    steps = [j for j in steps if j * hbs <= covered] or steps
                num_tokens = hbs * data.draw(st.sampled_from(steps))
            else:
                pick = st.sampled_from(held) | st.integers(-1, n) if held else st.integers(-1, n)
                block_id = data.draw(pick)
                block_size = data.draw(st.integers(1, 3 * hbs + 1))
                num_tokens = data.draw(st.integers(-1, len(request.block_hashes) * hbs + 1))
            group = _group(data, groups, valid)
        pair.last_partial = (request, block_id, num_tokens, group, block_size)
        pair.step(
            lambda s: model.cache_partial_block(
                s, request, block_id, num_tokens, group, block_size
            ),
            lambda p: p.cache_partial_block(
                request, pair.block(block_id), num_tokens, group, block_size
            ),
        )
    elif kind == "get_cached":
        probe = data.draw(st.sampled_from(HASHES) | st.sampled_from([h + h for h in HASHES]))
        group_ids = data.draw(st.lists(st.integers(0 if valid else -1, groups - 1), max_size=3))
        pair.step(
            lambda s: (s, model.get_cached_block(s, probe, group_ids)),
            lambda p: p.get_cached_block(probe, group_ids),
            _ids,
        )
    elif kind == "evict":
        hashed = [i for i, b in enumerate(pair.state.blocks) if b.block_hash is not None]
        pick = st.integers(0 if valid else -1, n - 1 if valid else n)
        if hashed and valid:
            pick = st.sampled_from(hashed) | pick
        id_set = data.draw(st.sets(pick, max_size=4))
        pair.step(lambda s: model.evict_blocks(s, id_set), lambda p: p.evict_blocks(id_set))
    elif kind == "reset":
        pair.step(model.reset_prefix_cache, lambda p: p.reset_prefix_cache())
    else:
        pair.step(model.take_events, lambda p: p.take_events(), tuple)


@given(configs(), st.integers(1, 3), st.data())
def test_impl_matches_model_step_by_step(
    config: model.PoolConfig, groups: int, data: st.DataObject
) -> None:
    pair = Pair(config)
    for _ in range(data.draw(st.integers(1, 40))):
        run_step(data, pair, groups)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("group", [0, 1])
def test_get_new_blocks_evicts_each_kind_of_cached_block_like_the_model(
    batch: bool, events: bool, group: int
) -> None:
    """``get_new_blocks`` evicts on paths of its own for one block (a decode step) and for
    several with events off. Three cached blocks at the front of the queue, taken one at a
    time or together: one whose key another block shares (the key stays with that block),
    that other block, and one with a partial key beside its primary key (every key goes)."""
    config = model.PoolConfig(
        num_blocks=5, enable_caching=True, hash_block_size=1, enable_events=events
    )
    pair = Pair(config)
    request = CacheRequest(block_hashes=(b"a", b"b"), all_token_ids=(1, 2, 3))
    pair.step(lambda s: model.get_new_blocks(s, 4), lambda p: p.get_new_blocks(4), _ids)
    for block_id in (1, 2):  # the same key (b"a", group) on two blocks
        pair.step(
            lambda s, i=block_id: model.cache_full_blocks(s, request, [i], 0, 1, 1, group),
            lambda p, i=block_id: p.cache_full_blocks(request, [p.blocks[i]], 0, 1, 1, group),
        )
    pair.step(
        lambda s: model.cache_full_blocks(s, request, [4, 3], 1, 2, 1, group),
        lambda p: p.cache_full_blocks(request, [p.blocks[4], p.blocks[3]], 1, 2, 1, group),
    )
    pair.step(  # block 3 is keyed at 2 tokens; a key at 1 token goes beside it
        lambda s: model.cache_partial_block(s, request, 3, 1, group, 2),
        lambda p: p.cache_partial_block(request, p.blocks[3], 1, group, 2),
    )
    pair.step(
        lambda s: model.free_blocks(s, [1, 2, 3, 4]),
        lambda p: p.free_blocks([p.blocks[i] for i in (1, 2, 3, 4)]),
    )
    # Block 4 has no key: freed to the front.
    for expected in [(4,), (1, 2, 3)] if batch else [(4,), (1,), (2,), (3,)]:
        n = len(expected)
        taken = pair.step(
            lambda s, n=n: model.get_new_blocks(s, n), lambda p, n=n: p.get_new_blocks(n), _ids
        )
        assert taken == expected
    if events:
        pair.step(model.take_events, lambda p: tuple(p.take_events()))


class _GroupId(int):
    """An int of a subclass: a valid group id."""


@pytest.mark.parametrize("group_id", ["0", 0.0, 1.5, None, b"\x00", _GroupId(0)])
def test_get_cached_block_takes_one_group_id_of_any_type_like_the_model(group_id: Any) -> None:
    """One group id (the path without loops) that is not a plain int: refused with the model's
    error even when ``int()`` would convert it, accepted when it is an int of a subclass."""
    config = model.PoolConfig(num_blocks=3, enable_caching=True, hash_block_size=1)
    pair = Pair(config)
    request = CacheRequest(block_hashes=(b"a",), all_token_ids=(1,))
    pair.step(lambda s: model.get_new_blocks(s, 1), lambda p: p.get_new_blocks(1), _ids)
    pair.step(
        lambda s: model.cache_full_blocks(s, request, [1], 0, 1, 1, 0),
        lambda p: p.cache_full_blocks(request, [p.blocks[1]], 0, 1, 1, 0),
    )
    pair.step(
        lambda s: (s, model.get_cached_block(s, b"a", [group_id])),
        lambda p: _ids(p.get_cached_block(b"a", [group_id])),
    )


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize(
    "events", [None, model.EventSemantics.MULTISET, model.EventSemantics.LAST_COPY]
)
def test_evicting_a_block_whose_partial_key_others_share_keeps_the_key_for_them(
    batch: bool, events: model.EventSemantics | None
) -> None:
    """A block with a partial key beside its primary key, where two other blocks carry that
    key as their primary key, is evicted first: the key stays with the other two (the map
    holds it for them again), and the removal is announced per copy (``multiset``) or not at
    all while a copy is left (``last-copy``). Then the other two go, the last one with the
    key's final removal."""
    profile = model.DEFAULT_PROFILE
    if events is not None:
        profile = with_event_semantics(profile, events)
    config = model.PoolConfig(
        num_blocks=5,
        enable_caching=True,
        hash_block_size=1,
        enable_events=events is not None,
        profile=profile,
    )
    pair = Pair(config)
    request = CacheRequest(block_hashes=(b"a", b"b"), all_token_ids=(1, 2, 3))
    pair.step(lambda s: model.get_new_blocks(s, 4), lambda p: p.get_new_blocks(4), _ids)
    for block_id in (1, 2):  # (b"a", 0) as the primary key of two blocks
        pair.step(
            lambda s, i=block_id: model.cache_full_blocks(s, request, [i], 0, 1, 1, 0),
            lambda p, i=block_id: p.cache_full_blocks(request, [p.blocks[i]], 0, 1, 1, 0),
        )
    pair.step(  # block 3: keyed at 2 tokens, then (b"a", 0) at 1 token beside it
        lambda s: model.cache_full_blocks(s, request, [4, 3], 1, 2, 1, 0),
        lambda p: p.cache_full_blocks(request, [p.blocks[4], p.blocks[3]], 1, 2, 1, 0),
    )
    pair.step(
        lambda s: model.cache_partial_block(s, request, 3, 1, 0, 2),
        lambda p: p.cache_partial_block(request, p.blocks[3], 1, 0, 2),
    )
    pair.step(  # block 4 has no key: to the front; then 3 before 1 and 2
        lambda s: model.free_blocks(s, [3, 1, 2, 4]),
        lambda p: p.free_blocks([p.blocks[i] for i in (3, 1, 2, 4)]),
    )
    for expected in [(4,), (3, 1, 2)] if batch else [(4,), (3,), (1,), (2,)]:
        n = len(expected)
        taken = pair.step(
            lambda s, n=n: model.get_new_blocks(s, n), lambda p, n=n: p.get_new_blocks(n), _ids
        )
        assert taken == expected
        if events is not None:
            pair.step(model.take_events, lambda p: tuple(p.take_events()))


@pytest.mark.parametrize("group_ids", [[0, 1], [1, 0], [0, 0], [1, 1], [0, 2], [0, -1]])
def test_get_cached_block_in_several_groups_like_the_model(group_ids: list[int]) -> None:
    """Several group ids (the path with loops), group 0 among them: a hit in every group, a
    miss in a group without the key, a negative group refused."""
    config = model.PoolConfig(num_blocks=4, enable_caching=True, hash_block_size=1)
    pair = Pair(config)
    request = CacheRequest(block_hashes=(b"a",), all_token_ids=(1,))
    pair.step(lambda s: model.get_new_blocks(s, 2), lambda p: p.get_new_blocks(2), _ids)
    for block_id, group in ((1, 0), (2, 1)):  # (b"a", 0) on block 1, (b"a", 1) on block 2
        pair.step(
            lambda s, i=block_id, g=group: model.cache_full_blocks(s, request, [i], 0, 1, 1, g),
            lambda p, i=block_id, g=group: p.cache_full_blocks(request, [p.blocks[i]], 0, 1, 1, g),
        )
    pair.step(
        lambda s: (s, model.get_cached_block(s, b"a", group_ids)),
        lambda p: _ids(p.get_cached_block(b"a", group_ids)),
    )
