"""evict_blocks: remove every hash of the given blocks from the prefix cache."""

from kvpool.model import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockState,
    CacheRequest,
    UnknownBlock,
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_new_blocks,
    new_pool,
    take_events,
)
from tests.model.helpers import H0, H1, H2, REQ, Run, assert_rejected, cached, held

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_negative_block_id() -> None:
    assert_rejected(lambda: cached(4, 2), UnknownBlock, evict_blocks, {1, -1})


def test_invalid_block_id_equal_to_the_pool_size() -> None:
    assert_rejected(lambda: cached(4, 2), UnknownBlock, evict_blocks, {1, 4})


def test_invalid_large_block_id_evicts_none_of_the_valid_ones() -> None:
    build = lambda: cached(4, 3, enable_events=True)  # noqa: E731
    assert_rejected(build, UnknownBlock, evict_blocks, [3, 2, 1, 100])


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_held_block_loses_its_hash_and_stays_held() -> None:
    state, result = evict_blocks(cached(4, 2), {1})
    assert result is None
    assert state.blocks[1] == BlockState(ref_cnt=1)
    assert dict(state.cached) == {(H1, 0): (2,)}
    assert state.free_queue == (3,)


def test_free_block_loses_its_hash_and_keeps_its_place_in_the_queue() -> None:
    state, _ = free_blocks(cached(5, 3), [1, 2, 3])
    assert state.free_queue == (4, 1, 2, 3)
    state, _ = evict_blocks(state, {2})
    assert state.free_queue == (4, 1, 2, 3)
    assert state.blocks[2] == BlockState()
    assert dict(state.cached) == {(H0, 0): (1,), (H2, 0): (3,)}


def test_emits_one_removal_per_block_in_ascending_id_order() -> None:
    state, _ = take_events(cached(5, 3, enable_events=True))
    state, _ = evict_blocks(state, [3, 1, 3])
    assert state.pending_events == (
        BlockRemoved((H0,), MEDIUM_GPU, 0),
        BlockRemoved((H2,), MEDIUM_GPU, 0),
    )


def test_removes_every_key_of_a_block_primary_first() -> None:
    request = CacheRequest((b"p2", b"p4"))
    run = Run(new_pool(2, hash_block_size=2, enable_events=True))
    run.do(get_new_blocks, 1)
    run.do(cache_partial_block, request, 1, 4, 0, 6)
    run.do(cache_partial_block, request, 1, 2, 0, 6)
    run.events()
    run.do(evict_blocks, {1})
    assert run.state.blocks[1] == BlockState(ref_cnt=1)
    assert dict(run.state.cached) == {}
    assert run.events() == (
        BlockRemoved((b"p4",), MEDIUM_GPU, 0),
        BlockRemoved((b"p2",), MEDIUM_GPU, 0),
    )


def test_evicting_one_of_two_blocks_under_a_hash_keeps_the_other() -> None:
    state, _ = get_new_blocks(new_pool(3), 2)
    state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, REQ, [2], 0, 1, 1, 0)
    state, _ = evict_blocks(state, {1})
    assert dict(state.cached) == {(H0, 0): (2,)}
    assert state.blocks[2].block_hash == (H0, 0)


def test_hashless_and_null_blocks_are_left_alone_without_event() -> None:
    state = held(4, 2, enable_events=True)
    after, _ = evict_blocks(state, {0, 1, 3})
    assert after == held(4, 2, enable_events=True)


def test_evicting_nothing_changes_nothing() -> None:
    after, _ = evict_blocks(cached(3, 2), set())
    assert after == cached(3, 2)


def test_no_event_when_events_are_disabled() -> None:
    state, _ = evict_blocks(cached(3, 2), {1, 2})
    assert dict(state.cached) == {}
    assert state.pending_events == ()
