"""The v0 model, rule by rule: allocation, de-duplication, copy-on-write, fork, the evictor."""

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.model import InvalidConfig, PoolError, UnknownBlock, v0
from kvpool.model.v0 import NEVER_ACCESSED, EvictorEntry, V0State
from kvpool.model.v0_errors import (
    BlockNotTracked,
    BlockOverflow,
    FreedPrefix,
    ImmutableBlock,
    NoFreeBlocks,
    NotPromotable,
    UnfilledPrefix,
    UnknownHandle,
    WrongTokenCount,
)
from kvpool.specs.v0.invariants import cached_prefix_closed, check_all
from tests.v0.helpers import shared_prefix_state

# --------------------------------------------------------------------------
# Allocation and the hash-less free list
# --------------------------------------------------------------------------


def test_new_allocator_has_every_block_hashless_and_free_in_id_order() -> None:
    state = v0.new_allocator(3, 2)
    assert state.hashless_free == (0, 1, 2)
    assert v0.get_num_free_blocks(state) == v0.get_num_total_blocks(state) == 3
    check_all(state)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(-1, 1), (1, 0)])
def test_new_allocator_rejects_bad_parameters(num_blocks: int, block_size: int) -> None:
    with pytest.raises(InvalidConfig):
        v0.new_allocator(num_blocks, block_size)


def test_a_freed_mutable_block_goes_to_the_front_and_is_handed_out_next() -> None:
    state, a = v0.allocate_mutable_block(v0.new_allocator(3, 2))
    state, _ = v0.free(state, a)
    assert state.hashless_free == (0, 1, 2)
    state, b = v0.allocate_mutable_block(state)
    state, c = v0.allocate_mutable_block(state)
    state, _ = v0.free(state, b)
    assert state.hashless_free == (0, 2)
    assert state.handles[c].block_id == 1


def test_allocation_evicts_only_when_no_hashless_block_is_left() -> None:
    state = shared_prefix_state()  # block 3 hash-less free, block 2 evictable
    state, a = v0.allocate_mutable_block(state)
    assert state.handles[a].block_id == 3 and 2 in state.evictor
    state, b = v0.allocate_mutable_block(state)
    assert state.handles[b].block_id == 2
    assert (88, 89) not in state.cached and not state.evictor
    with pytest.raises(NoFreeBlocks):
        v0.allocate_mutable_block(state)


def test_an_immutable_block_hits_the_cache_and_takes_its_block_back_from_the_evictor() -> None:
    state = shared_prefix_state()
    state, handle = v0.allocate_immutable_block(state, None, [88, 89])
    assert state.handles[handle].block_id == 2
    assert 2 not in state.evictor
    assert state.blocks[2].ref_cnt == 1 and state.blocks[2].computed  # a hit is computed
    check_all(state)


def test_an_immutable_block_miss_is_cached_and_touched_not_computed() -> None:
    state, _handle = v0.allocate_immutable_block(v0.new_allocator(2, 2), None, [1, 2])
    assert state.cached == {(1, 2): 0} and state.touched == {0}
    assert not state.blocks[0].computed
    state, _ = v0.mark_blocks_as_computed(state, [123])  # the argument is ignored
    assert state.blocks[0].computed and not state.touched


def test_allocate_immutable_blocks_chains_the_hashes_and_is_all_or_nothing() -> None:
    state, handles = v0.allocate_immutable_blocks(v0.new_allocator(2, 1), None, [[1], [2]])
    assert [state.handles[h].content_hash for h in handles] == [(1,), (1, 2)]
    assert state.handles[handles[1]].prev == handles[0]
    before = state
    with pytest.raises(NoFreeBlocks):
        v0.allocate_immutable_blocks(state, None, [[1], [3]])  # [1] hits, [1, 3] needs a block
    assert state == before


# --------------------------------------------------------------------------
# Appending, promotion and de-duplication
# --------------------------------------------------------------------------


def test_a_block_is_promoted_when_it_fills() -> None:
    state, a = v0.allocate_mutable_block(v0.new_allocator(2, 2))
    state, _ = v0.append_token_ids(state, a, [1])
    assert state.handles[a].content_hash is None and not state.cached
    state, block_id = v0.append_token_ids(state, a, [2])
    assert block_id == 0 and state.handles[a].content_hash == (1, 2)
    assert state.cached == {(1, 2): 0}


def test_a_full_block_whose_content_is_cached_is_deduplicated() -> None:
    state, _a = v0.allocate_immutable_block(v0.new_allocator(3, 2), None, [1, 2])
    state, b = v0.allocate_mutable_block(state)
    assert state.handles[b].block_id == 1
    state, block_id = v0.append_token_ids(state, b, [1, 2])
    assert block_id == 0 and state.handles[b].block_id == 0
    assert state.blocks[0].ref_cnt == 2 and state.blocks[1].ref_cnt == 0
    assert state.hashless_free == (1, 2)  # the duplicate's block is pushed on the front
    check_all(state)


def test_deduplication_onto_an_evictable_block_takes_it_back() -> None:
    state, a = v0.allocate_immutable_block(v0.new_allocator(2, 1), None, [5])
    state, _ = v0.free(state, a)
    state, b = v0.allocate_mutable_block(state)
    state, block_id = v0.append_token_ids(state, b, [5])
    assert block_id == 0 and not state.evictor and state.blocks[0].computed
    assert state.hashless_free == (1,)


def test_appending_nothing_changes_nothing() -> None:
    state, a = v0.allocate_mutable_block(v0.new_allocator(1, 2))
    state, _ = v0.fork(state, a)  # shared: a real append would copy
    assert v0.append_token_ids(state, a, []) == (state, 0)


def test_promote_to_immutable_block_rejects_blocks_the_other_operations_promoted() -> None:
    state, a = v0.allocate_immutable_block(v0.new_allocator(1, 1), None, [1])
    with pytest.raises(NotPromotable):
        v0.promote_to_immutable_block(state, a)


# --------------------------------------------------------------------------
# Fork and copy-on-write
# --------------------------------------------------------------------------


def test_fork_shares_every_block_of_the_sequence() -> None:
    state = shared_prefix_state()
    state, (f0, f1) = v0.fork(state, 1)
    assert [state.handles[h].block_id for h in (f0, f1)] == [0, 1]
    assert state.handles[f1].prev == f0 and state.handles[f1].token_ids == (67,)
    assert state.blocks[0].ref_cnt == 3 and state.blocks[1].ref_cnt == 2
    check_all(state)


def test_appending_to_a_shared_block_copies_it_first() -> None:
    state = shared_prefix_state()
    state, (_, f1) = v0.fork(state, 1)
    state, block_id = v0.append_token_ids(state, f1, [68])
    assert block_id == 3  # the hash-less free block
    assert state.copy_on_writes == ((1, 3),)
    assert state.handles[1].token_ids == (67,) and state.handles[1].block_id == 1
    assert state.cached[(65, 66, 67, 68)] == 3
    state, cows = v0.clear_copy_on_writes(state)
    assert cows == ((1, 3),) and state.copy_on_writes == ()
    check_all(state)


def test_the_last_holder_appends_in_place() -> None:
    state = shared_prefix_state()
    assert v0.cow_block_if_not_appendable(state, 1) == (state, 1)


def test_copy_on_write_without_a_free_block_is_rejected_and_changes_nothing() -> None:
    state, a = v0.allocate_mutable_block(v0.new_allocator(1, 2))
    state, _ = v0.fork(state, a)
    calls: list[Callable[[V0State], object]] = [
        lambda s: v0.append_token_ids(s, a, [1]),
        lambda s: v0.cow_block_if_not_appendable(s, a),
    ]
    for call in calls:
        with pytest.raises(NoFreeBlocks):
            call(state)


def test_a_copy_is_recorded_even_when_deduplication_releases_it() -> None:
    state, _a = v0.allocate_immutable_block(v0.new_allocator(3, 1), None, [7])
    state, b = v0.allocate_mutable_block(state)
    state, _ = v0.fork(state, b)
    state, block_id = v0.append_token_ids(state, b, [7])
    assert block_id == 0 and state.copy_on_writes == ((1, 2),)
    assert state.hashless_free == (2,)


# --------------------------------------------------------------------------
# Freeing and the evictor
# --------------------------------------------------------------------------


def test_a_freed_cached_block_joins_the_evictor_with_its_last_access() -> None:
    state, a = v0.allocate_immutable_block(v0.new_allocator(1, 2), None, [1, 2])
    state, _ = v0.mark_blocks_as_accessed(state, [0], 7.5)
    state, _ = v0.free(state, a)
    assert state.evictor == {0: EvictorEntry((1, 2), 2, 7.5)}
    assert state.blocks[0].last_accessed == NEVER_ACCESSED and v0.get_num_free_blocks(state) == 1


def test_eviction_is_least_recently_accessed_then_most_tokens_then_lowest_id() -> None:
    state, (a, b, c) = v0.allocate_immutable_blocks(v0.new_allocator(4, 1), None, [[1], [2], [3]])
    state, d = v0.allocate_immutable_block(state, None, [9])
    state, _ = v0.mark_blocks_as_accessed(state, [0, 1, 2, 3], 5)
    state, _ = v0.mark_blocks_as_accessed(state, [2], 6)
    for handle in (a, b, c, d):
        state, _ = v0.free(state, handle)
    # blocks 0 and 3 hash 1 token each at t=5, block 1 two tokens at t=5, block 2 at t=6
    assert v0.eviction_order(state) == (1, 0, 3, 2)
    state, e = v0.allocate_mutable_block(state)
    assert state.handles[e].block_id == 1 and (1, 2) not in state.cached


def test_marking_an_evictable_block_re_ranks_it() -> None:
    state, (a, b) = v0.allocate_immutable_blocks(v0.new_allocator(2, 1), None, [[1], [2]])
    state, _ = v0.free(state, a)
    state, _ = v0.free(state, b)
    assert v0.eviction_order(state) == (1, 0)
    state, _ = v0.mark_blocks_as_accessed(state, [1], 3)
    assert v0.eviction_order(state) == (0, 1)


def test_mark_blocks_as_accessed_rejects_free_hashless_and_unknown_blocks() -> None:
    state = v0.new_allocator(2, 1)
    with pytest.raises(BlockNotTracked):
        v0.mark_blocks_as_accessed(state, [0], 1)
    with pytest.raises(UnknownBlock):
        v0.mark_blocks_as_accessed(state, [2], 1)


def test_a_stale_touch_marks_the_blocks_new_content_computed() -> None:
    """vLLM's rule, kept: touched blocks are remembered by id."""
    state, a = v0.allocate_immutable_block(v0.new_allocator(1, 1), None, [1])
    state, _ = v0.free(state, a)
    state, b = v0.allocate_mutable_block(state)  # evicts block 0, still touched
    state, _ = v0.mark_blocks_as_computed(state)
    state, _ = v0.append_token_ids(state, b, [2])
    assert state.blocks[0].computed and v0.block_is_computed(state, 0)


def test_reset_prefix_cache_refuses_while_held_and_empties_the_evictor_in_order() -> None:
    state = shared_prefix_state()
    assert v0.reset_prefix_cache(state) == (state, False)
    for handle in sorted(state.handles):
        state, _ = v0.free(state, handle)
    order = v0.eviction_order(state)
    state, done = v0.reset_prefix_cache(state)
    assert done and not state.cached and not state.evictor
    assert state.hashless_free[: len(order)] == tuple(reversed(order))
    check_all(state)


# --------------------------------------------------------------------------
# Lookups
# --------------------------------------------------------------------------


def test_find_cached_blocks_prefix_needs_cached_and_computed() -> None:
    state, _ = v0.allocate_immutable_blocks(v0.new_allocator(3, 1), None, [[1], [2]])
    hashes = v0.content_hashes([1, 2, 3], 1)
    assert v0.find_cached_blocks_prefix(state, hashes) == ()  # touched, not computed yet
    state, _ = v0.mark_blocks_as_computed(state)
    assert v0.find_cached_blocks_prefix(state, hashes) == ((1,), (1, 2))


def test_without_the_binary_search_property_an_evicted_block_is_counted() -> None:
    state, hs = v0.allocate_immutable_blocks(v0.new_allocator(3, 1), None, [[1], [2], [3]])
    state, _ = v0.mark_blocks_as_computed(state)
    state, _ = v0.mark_blocks_as_accessed(state, [0], 1)
    state, _ = v0.mark_blocks_as_accessed(state, [1, 2], 2)
    for handle in hs:
        state, _ = v0.free(state, handle)
    state, _ = v0.allocate_mutable_block(state)  # evicts block 0: (1,) is gone
    assert cached_prefix_closed(state) is not None
    hashes = v0.content_hashes([1, 2, 3], 1)
    assert (1,) not in state.cached
    assert v0.find_cached_blocks_prefix(state, hashes) == hashes  # all three, the first evicted


@given(
    contents=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=4), max_size=4),
    query=st.lists(st.integers(1, 2), max_size=5),
)
def test_with_the_property_the_search_finds_the_longest_cached_prefix(
    contents: list[list[int]], query: list[int]
) -> None:
    state = v0.new_allocator(16, 1)  # room for 4 prompts of 4 blocks
    for tokens in contents:
        state, _ = v0.allocate_immutable_blocks(state, None, [[t] for t in tokens])
    state, _ = v0.mark_blocks_as_computed(state)
    assert cached_prefix_closed(state) is None
    hashes = v0.content_hashes(query, 1)
    longest = 0
    while longest < len(hashes) and hashes[longest] in state.cached:
        longest += 1
    assert v0.find_cached_blocks_prefix(state, hashes) == hashes[:longest]


@pytest.mark.parametrize(
    ("lists", "common"),
    [([[1, 2]], (1, 2)), ([[]], ()), ([], ()), ([[], []], ()), ([[1, 2, 3], [1, 2], []], (1, 2))],
)
def test_get_common_computed_block_ids(lists: list[list[int]], common: tuple[int, ...]) -> None:
    assert v0.get_common_computed_block_ids(lists) == common


# --------------------------------------------------------------------------
# Rejections
# --------------------------------------------------------------------------


def _rejections() -> list[tuple[str, object, type[PoolError]]]:
    state = shared_prefix_state()  # 1 is a mutable tail after the full 0
    state, lookahead = v0.allocate_mutable_block(state, 1)  # after a block that is not full
    gone, _ = v0.free(state, 0)
    return [
        ("free a dead handle", lambda: v0.free(state, 99), UnknownHandle),
        ("prev is dead", lambda: v0.allocate_mutable_block(state, 99), UnknownHandle),
        ("append to a full block", lambda: v0.append_token_ids(state, 0, [1]), ImmutableBlock),
        ("cow a full block", lambda: v0.cow_block_if_not_appendable(state, 0), ImmutableBlock),
        ("overflow", lambda: v0.append_token_ids(state, 1, [1, 2]), BlockOverflow),
        ("short immutable", lambda: v0.allocate_immutable_block(state, None, [1]), WrongTokenCount),
        ("unfilled prefix", lambda: v0.append_token_ids(state, lookahead, [1]), UnfilledPrefix),
        ("after unfilled", lambda: v0.allocate_immutable_block(state, 1, [1, 2]), UnfilledPrefix),
        ("freed prefix", lambda: v0.append_token_ids(gone, 1, [1]), FreedPrefix),
        ("fork over a freed block", lambda: v0.fork(gone, 1), FreedPrefix),
        ("promote a mutable block", lambda: v0.promote_to_immutable_block(state, 1), NotPromotable),
    ]


@pytest.mark.parametrize(("name", "call", "error"), _rejections(), ids=lambda v: str(v)[:30])
def test_each_precondition_has_its_own_rejection(name: str, call: object, error: type) -> None:
    assert callable(call)
    with pytest.raises(error):
        call()
