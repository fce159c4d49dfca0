"""get_new_blocks: hand out the front of the free queue, evicting any hashes."""

from hypothesis import given
from hypothesis import strategies as st

from kvpool.model import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockState,
    CacheRequest,
    InvalidBlockCount,
    NotEnoughFreeBlocks,
    PoolState,
    cache_full_blocks,
    cache_partial_block,
    free_blocks,
    get_new_blocks,
    new_pool,
    take_events,
)
from tests.model.helpers import H0, H1, REQ, Run, assert_rejected, cached, held

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_negative_count() -> None:
    assert_rejected(lambda: held(4, 1), InvalidBlockCount, get_new_blocks, -1)


def test_invalid_count_larger_than_free_count() -> None:
    assert_rejected(lambda: held(4, 1), NotEnoughFreeBlocks, get_new_blocks, 3)


def test_invalid_any_count_from_a_pool_with_nothing_free() -> None:
    assert_rejected(lambda: new_pool(1), NotEnoughFreeBlocks, get_new_blocks, 1)


def test_invalid_count_larger_than_free_count_leaves_cached_free_blocks_cached() -> None:
    def build() -> PoolState:
        state = cached(4, 2)
        state, _ = free_blocks(state, [2, 1])
        return state

    assert_rejected(build, NotEnoughFreeBlocks, get_new_blocks, 4)


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_hands_out_the_front_of_the_queue_each_held_once() -> None:
    state, ids = get_new_blocks(new_pool(5), 2)
    assert ids == (1, 2)
    assert state.free_queue == (3, 4)
    assert [b.ref_cnt for b in state.blocks] == [0, 1, 1, 0, 0]


def test_zero_blocks_returns_nothing_and_changes_nothing() -> None:
    state = held(4, 1)
    after, ids = get_new_blocks(state, 0)
    assert ids == ()
    assert after == held(4, 1)


def test_every_free_block_can_be_taken() -> None:
    state, ids = get_new_blocks(new_pool(4), 3)
    assert ids == (1, 2, 3)
    assert state.free_queue == ()


def test_follows_queue_order_not_id_order() -> None:
    state = held(5, 4)
    state, _ = free_blocks(state, [3, 1])  # hash-less: front, in the order given
    assert state.free_queue == (3, 1)
    state, ids = get_new_blocks(state, 1)
    assert ids == (3,)
    assert state.free_queue == (1,)


def test_evicts_the_hash_of_a_cached_free_block_it_hands_out() -> None:
    state = cached(3, 2, enable_events=True)
    state, _ = free_blocks(state, [1, 2])
    state, _ = take_events(state)
    state, ids = get_new_blocks(state, 1)
    assert ids == (1,)
    assert state.blocks[1] == BlockState(ref_cnt=1)
    assert dict(state.cached) == {(H1, 0): (2,)}
    assert state.pending_events == (BlockRemoved((H0,), MEDIUM_GPU, 0),)


def test_evicts_every_key_of_a_block_with_partial_entries() -> None:
    request = CacheRequest(block_hashes=(b"p2", b"p4"))
    run = Run(new_pool(2, hash_block_size=2, enable_events=True))
    (b,) = run.do(get_new_blocks, 1)
    run.do(cache_partial_block, request, b, 4, 0, 6)
    run.do(cache_partial_block, request, b, 2, 0, 6)  # beside the primary key
    run.do(free_blocks, [b])
    run.events()
    assert run.do(get_new_blocks, 1) == (b,)
    assert run.state.blocks[b] == BlockState(ref_cnt=1)
    assert dict(run.state.cached) == {}
    assert run.events() == (
        BlockRemoved((b"p4",), MEDIUM_GPU, 0),
        BlockRemoved((b"p2",), MEDIUM_GPU, 0),
    )


def test_evicting_one_of_two_blocks_under_a_hash_keeps_the_other() -> None:
    run = Run(new_pool(3))
    ids = run.do(get_new_blocks, 2)
    run.do(cache_full_blocks, REQ, ids[:1], 0, 1, 1, 0)
    run.do(cache_full_blocks, REQ, ids[1:], 0, 1, 1, 0)
    assert dict(run.state.cached) == {(H0, 0): (1, 2)}
    run.do(free_blocks, [1])
    assert run.do(get_new_blocks, 1) == (1,)
    assert dict(run.state.cached) == {(H0, 0): (2,)}


def test_eviction_without_events_queues_nothing() -> None:
    state = cached(2, 1)
    state, _ = free_blocks(state, [1])
    state, _ = get_new_blocks(state, 1)
    assert dict(state.cached) == {}
    assert state.pending_events == ()


def test_hashless_blocks_emit_no_removal() -> None:
    state, _ = get_new_blocks(new_pool(3, enable_events=True), 2)
    assert state.pending_events == ()


@given(st.integers(1, 8), st.data())
def test_takes_exactly_the_first_n_of_the_queue(num_blocks: int, data: st.DataObject) -> None:
    state = new_pool(num_blocks)
    n = data.draw(st.integers(0, num_blocks - 1))
    after, ids = get_new_blocks(state, n)
    assert ids == state.free_queue[:n]
    assert after.free_queue == state.free_queue[n:]
    assert all(after.blocks[b].ref_cnt == 1 for b in ids)
