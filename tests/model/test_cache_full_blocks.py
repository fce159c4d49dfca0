"""cache_full_blocks: insert a request's newly full blocks into the hash map."""

from hypothesis import given
from hypothesis import strategies as st

from kvpool.model import (
    MEDIUM_GPU,
    AlreadyCached,
    BlockNotHeld,
    BlockRemoved,
    BlockState,
    BlockStored,
    CacheRequest,
    CachingDisabled,
    DuplicateBlock,
    InvalidBlockMask,
    InvalidBlockRange,
    InvalidBlockSize,
    InvalidGroup,
    NotEnoughHashes,
    PoolState,
    UnknownBlock,
    cache_full_blocks,
    cache_partial_block,
    get_new_blocks,
    hashes_at_block_size,
    new_pool,
    take_events,
)
from tests.model.helpers import H0, H1, H2, REQ, Run, assert_rejected, held


def held_hbs2() -> PoolState:
    """hash_block_size 2, blocks 1 and 2 held."""
    return held(4, 2, hash_block_size=2)


# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_caching_disabled() -> None:
    build = lambda: held(4, 2, enable_caching=False)  # noqa: E731
    assert_rejected(build, CachingDisabled, cache_full_blocks, REQ, [1, 2], 0, 2, 1, 0)


def test_invalid_negative_group() -> None:
    assert_rejected(lambda: held(4, 2), InvalidGroup, cache_full_blocks, REQ, [1, 2], 0, 2, 1, -1)


def test_invalid_negative_block_id() -> None:
    assert_rejected(lambda: held(4, 2), UnknownBlock, cache_full_blocks, REQ, [1, -1], 0, 2, 1, 0)


def test_invalid_block_id_equal_to_the_pool_size() -> None:
    assert_rejected(lambda: held(4, 2), UnknownBlock, cache_full_blocks, REQ, [1, 4], 0, 2, 1, 0)


def test_invalid_block_size_not_a_multiple_of_the_hash_block_size() -> None:
    assert_rejected(held_hbs2, InvalidBlockSize, cache_full_blocks, REQ, [1, 2], 0, 1, 3, 0)


def test_invalid_block_size_smaller_than_the_hash_block_size() -> None:
    assert_rejected(held_hbs2, InvalidBlockSize, cache_full_blocks, REQ, [1, 2], 0, 1, 1, 0)


def test_invalid_block_size_zero() -> None:
    build = lambda: held(4, 2)  # noqa: E731
    assert_rejected(build, InvalidBlockSize, cache_full_blocks, REQ, [1, 2], 0, 1, 0, 0)


def test_invalid_range_with_negative_num_cached_blocks() -> None:
    build = lambda: held(4, 2)  # noqa: E731
    assert_rejected(build, InvalidBlockRange, cache_full_blocks, REQ, [1, 2], -1, 2, 1, 0)


def test_invalid_range_past_the_end_of_the_blocks() -> None:
    build = lambda: held(4, 2)  # noqa: E731
    assert_rejected(build, InvalidBlockRange, cache_full_blocks, REQ, [1, 2], 0, 3, 1, 0)


def test_invalid_mask_shorter_than_the_range() -> None:
    build = lambda: held(4, 2)  # noqa: E731
    args = (REQ, [1, 2], 0, 2, 1, 0, [True])
    assert_rejected(build, InvalidBlockMask, cache_full_blocks, *args)


def test_invalid_mask_longer_than_the_range() -> None:
    build = lambda: held(4, 2)  # noqa: E731
    args = (REQ, [1, 2], 1, 2, 1, 0, [True, True])
    assert_rejected(build, InvalidBlockMask, cache_full_blocks, *args)


def test_invalid_more_full_blocks_than_the_request_has_hashes() -> None:
    short = CacheRequest(block_hashes=(H0,))
    build = lambda: held(4, 2)  # noqa: E731
    assert_rejected(build, NotEnoughHashes, cache_full_blocks, short, [1, 2], 0, 2, 1, 0)


def test_invalid_too_few_hashes_at_a_larger_block_size() -> None:
    # three size-1 hashes name only one block of size 2
    request = CacheRequest(block_hashes=(H0, H1, H2))
    build = lambda: held(4, 2)  # noqa: E731
    assert_rejected(build, NotEnoughHashes, cache_full_blocks, request, [1, 2], 0, 2, 2, 0)


def test_invalid_duplicate_block_in_the_range() -> None:
    assert_rejected(lambda: held(4, 2), DuplicateBlock, cache_full_blocks, REQ, [1, 1], 0, 2, 1, 0)


def test_invalid_caching_a_free_block() -> None:
    assert_rejected(lambda: held(4, 1), BlockNotHeld, cache_full_blocks, REQ, [1, 2], 0, 2, 1, 0)


def test_invalid_caching_an_already_cached_full_block() -> None:
    def build() -> PoolState:
        state = held(4, 2)
        state, _ = cache_full_blocks(state, REQ, [1, 2], 1, 2, 1, 0)
        return state

    # block 1 alone would be fine: the whole call is refused because of block 2
    assert_rejected(build, AlreadyCached, cache_full_blocks, REQ, [1, 2], 0, 2, 1, 0)


def test_invalid_caching_a_full_block_again_under_another_group() -> None:
    def build() -> PoolState:
        state = held(4, 1)
        state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
        return state

    assert_rejected(build, AlreadyCached, cache_full_blocks, REQ, [1], 0, 1, 1, 1)


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_caches_the_slice_from_num_cached_to_num_full() -> None:
    state, ids = get_new_blocks(new_pool(5), 3)
    state, result = cache_full_blocks(state, REQ, ids, 1, 3, 1, 0)
    assert result is None
    assert state.blocks[1] == BlockState(ref_cnt=1)
    assert state.blocks[2] == BlockState(ref_cnt=1, block_hash=(H1, 0), hash_num_tokens=2)
    assert state.blocks[3] == BlockState(ref_cnt=1, block_hash=(H2, 0), hash_num_tokens=3)
    assert dict(state.cached) == {(H1, 0): (2,), (H2, 0): (3,)}
    assert state.free_queue == (4,)


def test_key_carries_the_group_id() -> None:
    state, _ = cache_full_blocks(held(3, 1), REQ, [1], 0, 1, 1, 2)
    assert dict(state.cached) == {(H0, 2): (1,)}
    assert state.blocks[1].block_hash == (H0, 2)


def test_null_blocks_are_skipped() -> None:
    state, _ = cache_full_blocks(held(3, 1), REQ, [0, 1], 0, 2, 1, 0)
    assert state.blocks[0] == BlockState()
    assert dict(state.cached) == {(H1, 0): (1,)}
    assert state.blocks[1].hash_num_tokens == 2


def test_masked_out_blocks_are_skipped() -> None:
    state, ids = get_new_blocks(new_pool(4), 3)
    state, _ = cache_full_blocks(state, REQ, ids, 0, 3, 1, 0, [True, False, True])
    assert dict(state.cached) == {(H0, 0): (1,), (H2, 0): (3,)}
    assert state.blocks[2] == BlockState(ref_cnt=1)


def test_mask_is_aligned_with_the_slice_not_the_whole_list() -> None:
    state, ids = get_new_blocks(new_pool(4), 3)
    state, _ = cache_full_blocks(state, REQ, ids, 1, 3, 1, 0, [False, True])
    assert dict(state.cached) == {(H2, 0): (3,)}


def test_larger_block_size_uses_the_hash_at_each_blocks_last_boundary() -> None:
    request = CacheRequest(block_hashes=(b"a", b"b", b"c", b"d", b"e"))
    state, ids = get_new_blocks(new_pool(4, hash_block_size=2), 2)
    state, _ = cache_full_blocks(state, request, ids, 0, 2, 4, 0)
    # hashes are chained: the hash at a block's last hash-block boundary names it
    assert dict(state.cached) == {(b"b", 0): (1,), (b"d", 0): (2,)}
    assert state.blocks[1].hash_num_tokens == 4
    assert state.blocks[2].hash_num_tokens == 8


def test_second_block_with_an_existing_hash_is_inserted_beside_the_first() -> None:
    state, _ = get_new_blocks(new_pool(4), 2)
    state, _ = cache_full_blocks(state, REQ, [2], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
    assert dict(state.cached) == {(H0, 0): (2, 1)}
    assert state.blocks[1].block_hash == state.blocks[2].block_hash == (H0, 0)


def test_empty_range_is_a_no_op_without_event() -> None:
    state = held(4, 2, enable_events=True)
    after, _ = cache_full_blocks(state, REQ, [1, 2], 2, 2, 1, 0)
    assert after == held(4, 2, enable_events=True)
    after, _ = cache_full_blocks(state, REQ, [1, 2], 2, 1, 1, 0)
    assert after == held(4, 2, enable_events=True)


def test_stored_event_describes_the_cached_slice() -> None:
    request = CacheRequest((H0, H1, H2), (7, 8, 9), lora_id=3, lora_name="ad")
    state, ids = get_new_blocks(new_pool(5, enable_events=True), 3)
    state, _ = cache_full_blocks(state, request, ids, 1, 3, 1, 4)
    assert state.pending_events == (
        BlockStored(
            block_hashes=(H1, H2),
            parent_block_hash=H0,
            token_ids=(8, 9),
            block_size=1,
            lora_id=3,
            medium=MEDIUM_GPU,
            lora_name="ad",
            extra_keys=(None, None),
            group_idx=4,
        ),
    )


def test_stored_event_from_the_first_block_has_no_parent() -> None:
    request = CacheRequest((b"a", b"b", b"c", b"d"), tuple(range(8)))
    state, ids = get_new_blocks(new_pool(3, hash_block_size=2, enable_events=True), 1)
    state, _ = cache_full_blocks(state, request, ids, 0, 1, 4, 0)
    assert state.pending_events == (
        BlockStored((b"b",), None, (0, 1, 2, 3), 4, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_stored_event_parent_at_a_larger_block_size_is_the_previous_blocks_hash() -> None:
    request = CacheRequest((b"a", b"b", b"c", b"d"), tuple(range(8)))
    state, ids = get_new_blocks(new_pool(3, hash_block_size=2, enable_events=True), 2)
    state, _ = cache_full_blocks(state, request, ids, 1, 2, 4, 0)
    assert state.pending_events == (
        BlockStored((b"d",), b"b", (4, 5, 6, 7), 4, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_stored_event_skips_null_and_masked_hashes_but_spans_every_token() -> None:
    request = CacheRequest((H0, H1, H2), (7, 8, 9))
    state, _ = get_new_blocks(new_pool(4, enable_events=True), 2)
    state, _ = cache_full_blocks(state, request, [0, 1, 2], 0, 3, 1, 0, [True, True, False])
    assert state.pending_events == (
        BlockStored((H1,), None, (7, 8, 9), 1, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_stored_event_with_every_block_skipped_is_empty() -> None:
    state = new_pool(3, enable_events=True)
    state, _ = cache_full_blocks(state, REQ, [0], 0, 1, 1, 0)
    assert state.pending_events == (
        BlockStored((), None, (10,), 1, None, MEDIUM_GPU, None, None, 0),
    )
    assert dict(state.cached) == {}


def test_no_event_when_events_are_disabled() -> None:
    state, _ = cache_full_blocks(held(3, 1), REQ, [1], 0, 1, 1, 0)
    assert state.pending_events == ()


def test_promotes_a_partial_block_removing_its_partial_key_first() -> None:
    request = CacheRequest((b"a", b"b"), (1, 2, 3, 4))
    run = Run(new_pool(2, hash_block_size=2, enable_events=True))
    (b,) = run.do(get_new_blocks, 1)
    run.do(cache_partial_block, request, b, 2, 0, 4)
    run.events()
    run.do(cache_full_blocks, request, [b], 0, 1, 4, 0)
    assert run.state.blocks[b] == BlockState(ref_cnt=1, block_hash=(b"b", 0), hash_num_tokens=4)
    assert dict(run.state.cached) == {(b"b", 0): (b,)}
    assert run.events() == (
        BlockRemoved((b"a",), MEDIUM_GPU, 0),
        BlockStored((b"b",), None, (1, 2, 3, 4), 4, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_a_block_cached_at_a_shorter_prefix_is_re_keyed_at_a_longer_one() -> None:
    state, _ = cache_full_blocks(held(3, 1), REQ, [1], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, REQ, [2, 1], 1, 2, 1, 0)
    assert dict(state.cached) == {(H1, 0): (1,)}
    assert state.blocks[1].hash_num_tokens == 2


def test_caching_changes_neither_ref_counts_nor_the_free_queue() -> None:
    state = held(5, 2)
    after, _ = cache_full_blocks(state, REQ, [1, 2], 0, 2, 1, 0)
    assert after.free_queue == state.free_queue
    assert [b.ref_cnt for b in after.blocks] == [b.ref_cnt for b in state.blocks]


def test_take_events_drains_what_cache_full_blocks_queued() -> None:
    state, _ = cache_full_blocks(held(3, 1, enable_events=True), REQ, [1], 0, 1, 1, 0)
    state, events = take_events(state)
    assert len(events) == 1
    assert state.pending_events == ()


@given(st.integers(1, 4), st.lists(st.binary(min_size=1, max_size=2), max_size=9))
def test_hashes_at_block_size_takes_the_last_hash_of_each_full_group(
    factor: int, hashes: list[bytes]
) -> None:
    scaled = hashes_at_block_size(hashes, 1, factor)
    assert len(scaled) == len(hashes) // factor
    for i, h in enumerate(scaled):
        assert h == hashes[(i + 1) * factor - 1]
