"""free_blocks: drop one reference per listed block; blocks reaching zero become free."""

from hypothesis import given
from hypothesis import strategies as st

from kvpool.model import (
    APPEND,
    HASHLESS_FIRST,
    HASHLESS_FIRST_APPEND_UNCACHED,
    BlockNotHeld,
    BlockState,
    OverFree,
    PoolState,
    UnknownBlock,
    cache_full_blocks,
    free_blocks,
    get_new_blocks,
    get_num_free_blocks,
    new_pool,
    touch,
)
from kvpool.specs.pool.invariants import conservation
from tests.model.helpers import H0, H1, REQ, Run, assert_rejected, cached, held

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_negative_block_id() -> None:
    assert_rejected(lambda: held(4, 2), UnknownBlock, free_blocks, [1, -1])


def test_invalid_block_id_equal_to_the_pool_size() -> None:
    assert_rejected(lambda: held(4, 2), UnknownBlock, free_blocks, [1, 4])


def test_invalid_freeing_a_free_block() -> None:
    assert_rejected(lambda: held(4, 1), BlockNotHeld, free_blocks, [1, 2])


def test_invalid_freeing_a_free_cached_block_again() -> None:
    def build() -> PoolState:
        state, _ = free_blocks(cached(4, 2), [2])
        return state

    assert_rejected(build, BlockNotHeld, free_blocks, [2])


def test_invalid_same_held_once_block_twice_in_one_call() -> None:
    assert_rejected(lambda: held(4, 2), OverFree, free_blocks, [2, 1, 1])


def test_invalid_block_held_twice_freed_three_times() -> None:
    def build() -> PoolState:
        state, _ = touch(held(4, 1), [1])
        return state

    assert_rejected(build, OverFree, free_blocks, [1, 1, 1])


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_hashless_blocks_go_to_the_front_in_the_order_given() -> None:
    state, _ = free_blocks(held(5, 3), [3, 1])
    assert state.free_queue == (3, 1, 4)
    assert [b.ref_cnt for b in state.blocks] == [0, 0, 1, 0, 0]


def test_hashed_blocks_go_to_the_back_in_the_order_given() -> None:
    state, _ = free_blocks(cached(5, 3), [3, 1])
    assert state.free_queue == (4, 3, 1)


def test_mixed_call_splits_hashless_to_the_front_and_hashed_to_the_back() -> None:
    state, _ = get_new_blocks(new_pool(5), 3)
    state, _ = cache_full_blocks(state, REQ, [1, 2], 0, 2, 1, 0)
    state, _ = free_blocks(state, [1, 3, 2])
    assert state.free_queue == (3, 4, 1, 2)


def test_a_later_calls_hashless_blocks_go_in_front_of_an_earlier_calls() -> None:
    state, _ = free_blocks(held(5, 3), [1])
    state, _ = free_blocks(state, [2, 3])
    assert state.free_queue == (2, 3, 1, 4)


def test_a_later_calls_hashed_blocks_go_behind_an_earlier_calls() -> None:
    state, _ = free_blocks(cached(5, 3), [2])
    state, _ = free_blocks(state, [3, 1])
    assert state.free_queue == (4, 2, 3, 1)


def test_append_profile_puts_every_freed_block_at_the_back_in_the_order_given() -> None:
    state, _ = get_new_blocks(new_pool(5, profile=APPEND), 3)
    state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
    state, _ = free_blocks(state, [3, 1, 2])
    assert state.free_queue == (4, 3, 1, 2)


def test_hashless_first_profile_also_applies_without_caching() -> None:
    state = held(5, 3, enable_caching=False, profile=HASHLESS_FIRST)
    state, _ = free_blocks(state, [3, 1])
    assert state.free_queue == (3, 1, 4)


def test_release_0_27_profile_appends_without_caching() -> None:
    state = held(5, 3, enable_caching=False, profile=HASHLESS_FIRST_APPEND_UNCACHED)
    state, _ = free_blocks(state, [3, 1])
    assert state.free_queue == (4, 3, 1)


def test_release_0_27_profile_puts_hashless_first_with_caching() -> None:
    state = held(5, 3, profile=HASHLESS_FIRST_APPEND_UNCACHED)
    state, _ = free_blocks(state, [3, 1])
    assert state.free_queue == (3, 1, 4)


def test_block_held_twice_freed_once_stays_held_and_out_of_the_queue() -> None:
    state, _ = touch(held(4, 1), [1])
    state, _ = free_blocks(state, [1])
    assert state.blocks[1].ref_cnt == 1
    assert state.free_queue == (2, 3)


def test_block_listed_twice_releases_two_references_and_is_queued_once() -> None:
    state, _ = touch(held(4, 2), [1])
    state, _ = free_blocks(state, [1, 2, 1])
    assert state.blocks[1].ref_cnt == 0
    # block 1 reaches zero at its second occurrence, after block 2
    assert state.free_queue == (2, 1, 3)


def test_the_null_block_is_skipped() -> None:
    state, _ = free_blocks(held(3, 1), [0, 1, 0])
    assert state.blocks[0] == BlockState()
    assert state.free_queue == (1, 2)


def test_freed_cached_block_keeps_its_hash_and_map_entry() -> None:
    state, _ = free_blocks(cached(3, 2), [1])
    assert state.blocks[1] == BlockState(ref_cnt=0, block_hash=(H0, 0), hash_num_tokens=1)
    assert dict(state.cached) == {(H0, 0): (1,), (H1, 0): (2,)}


def test_freeing_emits_no_event() -> None:
    state = cached(3, 2, enable_events=True)
    after, _ = free_blocks(state, [2, 1])
    assert after.pending_events == state.pending_events


def test_freeing_nothing_changes_nothing() -> None:
    after, _ = free_blocks(held(3, 1), [])
    assert after == held(3, 1)


@given(st.integers(2, 8), st.data())
def test_freeing_all_taken_blocks_in_any_order_restores_the_free_count(
    num_blocks: int, data: st.DataObject
) -> None:
    run = Run(new_pool(num_blocks))
    n = data.draw(st.integers(1, num_blocks - 1))
    ids = run.do(get_new_blocks, n)
    order = data.draw(st.permutations(ids))
    cut = data.draw(st.integers(0, n))
    run.do(free_blocks, order[:cut])
    run.do(free_blocks, order[cut:])
    assert get_num_free_blocks(run.state) == num_blocks - 1
    assert conservation(run.state) is None
    assert all(b.ref_cnt == 0 for b in run.state.blocks)


@given(st.integers(2, 8), st.data())
def test_hashless_freed_blocks_precede_the_initial_ones_under_hashless_first(
    num_blocks: int, data: st.DataObject
) -> None:
    run = Run(new_pool(num_blocks, profile=HASHLESS_FIRST))
    n = data.draw(st.integers(1, num_blocks - 1))
    ids = run.do(get_new_blocks, n)
    to_free = data.draw(st.lists(st.sampled_from(ids), unique=True))
    initial = run.state.free_queue
    run.do(free_blocks, to_free)
    assert run.state.free_queue == (*to_free, *initial)


@given(st.integers(2, 8), st.data())
def test_every_freed_block_follows_the_initial_ones_under_append(
    num_blocks: int, data: st.DataObject
) -> None:
    run = Run(new_pool(num_blocks, profile=APPEND))
    n = data.draw(st.integers(1, num_blocks - 1))
    ids = run.do(get_new_blocks, n)
    to_free = data.draw(st.lists(st.sampled_from(ids), unique=True))
    initial = run.state.free_queue
    run.do(free_blocks, to_free)
    assert run.state.free_queue == (*initial, *to_free)
