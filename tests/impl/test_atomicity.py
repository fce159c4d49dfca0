"""Every public operation of the fast pool is atomic for any argument, well-typed or not.

issue 20 item 1: ``free_blocks([a, 3])`` used to raise AttributeError half-way and
lose block 3 from the free queue for good. Here random calls with randomly
ill-typed arguments (None, strings, floats, bools, other pools' blocks, lists
holding any of them) run on pools in random states: a call either succeeds with
the invariants intact, or raises one of the model's named errors with the
snapshot exactly as before. Nothing else may escape.
"""

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import CacheRequest, PoolError
from tests.impl.helpers import REQ, VllmStyleRequest

OTHER = BlockPool(4, True, 1)
"""Blocks of another pool: one more thing that is not a block of the pool under test."""

JUNK: list[Any] = [
    None,
    "1",
    b"h0",
    1.0,
    True,
    -1,
    10**6,
    [],
    {},
    object(),
    OTHER.blocks[1],
    KVCacheBlock(1),
    CacheRequest(("h0",), (1,)),  # type: ignore[arg-type]
    VllmStyleRequest([b"h0", 5], [1, 2]),  # type: ignore[list-item]
]


def junk() -> st.SearchStrategy[Any]:
    return st.sampled_from(JUNK) | st.lists(st.sampled_from(JUNK), max_size=2)


def build(data: st.DataObject) -> BlockPool:
    """A pool in a random reachable state: held, free, cached, shared and pinned blocks."""
    pool = BlockPool(
        data.draw(st.integers(2, 7)),
        data.draw(st.booleans()),
        data.draw(st.integers(1, 2)),
        enable_kv_cache_events=data.draw(st.booleans()),
        num_hash_lookahead_tokens=data.draw(st.integers(0, 2)),
    )
    held = pool.get_new_blocks(data.draw(st.integers(0, pool.get_num_free_blocks())))
    if pool.enable_caching and held:
        n = min(len(held), len(REQ.block_hashes) // pool.hash_block_size)
        pool.cache_full_blocks(REQ, held, 0, n, pool.hash_block_size, 0)
    # bool(held): with the list on the left of `and`, mypy would expect the draw to be a list
    if bool(held) and data.draw(st.booleans()):
        pool.unpin_blocks(held[-1:], lambda block: None)
        held = held[:-1]
    if bool(held) and data.draw(st.booleans()):
        pool.free_blocks(held[:1])
    return pool


def argument(data: st.DataObject, pool: BlockPool, kind: str) -> Any:
    """A well-typed value of ``kind`` about half the time, junk otherwise."""
    if data.draw(st.booleans()):
        return data.draw(junk())
    blocks = st.sampled_from(pool.blocks)
    well_typed: dict[str, st.SearchStrategy[Any]] = {
        "int": st.integers(-1, 8),
        "block": blocks,
        "blocks": st.lists(blocks | st.sampled_from(JUNK), max_size=3),
        "ids": st.lists(st.integers(-1, 8) | st.sampled_from(JUNK), max_size=3),
        "request": st.sampled_from([REQ, VllmStyleRequest([b"a", b"b"], [1, 2, 3, 4])]),
        "mask": st.none() | st.lists(st.booleans(), max_size=3),
        "bool": st.booleans(),
        "hash": st.sampled_from([b"h0", b"h1", b"x"]),
        "groups": st.lists(st.integers(-1, 2), max_size=2),
        "watcher": st.just(lambda block: None),
    }
    return data.draw(well_typed[kind])


OPERATIONS: dict[str, tuple[str, ...]] = {
    "get_new_blocks": ("int",),
    "touch": ("blocks",),
    "free_blocks": ("blocks",),
    "unpin_blocks": ("blocks", "watcher"),
    "move_block_hashes": ("block", "block"),
    "is_block_writable": ("block",),
    "cache_full_blocks": ("request", "blocks", "int", "int", "int", "int", "mask"),
    "cache_partial_block": ("request", "block", "int", "int", "int", "bool"),
    "emit_cached_block_events": ("request", "int", "int", "int"),
    "get_cached_block": ("hash", "groups"),
    "evict_blocks": ("ids",),
    "_maybe_evict_cached_block": ("block",),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_a_call_with_any_arguments_succeeds_whole_or_changes_nothing(
    operation: str, data: st.DataObject
) -> None:
    pool = build(data)
    args = [argument(data, pool, kind) for kind in OPERATIONS[operation]]
    before = pool.snapshot()
    other_before = OTHER.snapshot()
    method: Callable[..., Any] = getattr(pool, operation)
    try:
        method(*args)
    except PoolError:
        assert pool.snapshot() == before
        assert OTHER.snapshot() == other_before
    pool.check_invariants()
    OTHER.check_invariants()


def test_every_public_operation_is_covered() -> None:
    public = {
        name
        for name in dir(BlockPool)
        if not name.startswith("_") and callable(getattr(BlockPool, name))
    }
    queries = {"get_num_free_blocks", "get_usage", "take_events", "reset_prefix_cache"}
    introspection = {"snapshot", "check_invariants"}
    assert public - queries - introspection == set(OPERATIONS) - {"_maybe_evict_cached_block"}


def test_issue_20_free_with_an_int_among_blocks_changes_nothing() -> None:
    pool = BlockPool(4, True, 1)
    a, _ = pool.get_new_blocks(2)
    before = pool.snapshot()
    with pytest.raises(PoolError):
        pool.free_blocks([a, 3])  # type: ignore[list-item]
    assert pool.snapshot() == before
    pool.check_invariants()
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]


def test_issue_20_touch_with_none_among_blocks_changes_nothing() -> None:
    pool = BlockPool(4, True, 1)
    before = pool.snapshot()
    with pytest.raises(PoolError):
        pool.touch([pool.blocks[2], None])  # type: ignore[list-item]
    assert pool.snapshot() == before
    pool.check_invariants()
