"""emit_cached_block_events: re-announce a request's cached prefix (vLLM 0.33)."""

from kvpool.model import (
    BlockStored,
    CacheRequest,
    InvalidArgument,
    InvalidBlockCount,
    InvalidBlockSize,
    InvalidGroup,
    NotEnoughHashes,
    PoolState,
    emit_cached_block_events,
    new_pool,
)
from tests.model.helpers import H0, H1, H2, H3, REQ, assert_rejected


def events_on() -> PoolState:
    return new_pool(4, hash_block_size=1, enable_events=True)


def test_invalid_negative_group() -> None:
    assert_rejected(events_on, InvalidGroup, emit_cached_block_events, REQ, 1, 1, -1)


def test_invalid_block_size() -> None:
    assert_rejected(
        lambda: new_pool(4, hash_block_size=2, enable_events=True),
        InvalidBlockSize,
        emit_cached_block_events,
        REQ,
        1,
        3,
        0,
    )


def test_invalid_negative_count() -> None:
    assert_rejected(events_on, InvalidBlockCount, emit_cached_block_events, REQ, -1, 1, 0)


def test_invalid_more_blocks_than_hashes() -> None:
    assert_rejected(events_on, NotEnoughHashes, emit_cached_block_events, REQ, 3, 2, 0)


def test_invalid_count_of_another_type() -> None:
    assert_rejected(events_on, InvalidArgument, emit_cached_block_events, REQ, 1.0, 1, 0)


def test_invalid_hash_that_is_no_bytes() -> None:
    request = CacheRequest(("h0",), (1,))  # type: ignore[arg-type]
    assert_rejected(events_on, InvalidArgument, emit_cached_block_events, request, 1, 1, 0)


def test_one_stored_event_with_no_parent_and_the_prefix_tokens() -> None:
    state, _ = emit_cached_block_events(events_on(), REQ, 2, 2, 1)
    assert state.pending_events == (
        BlockStored((H1, H3), None, (10, 11, 12, 13), 2, None, "GPU", None, (None, None), 1),
    )
    assert state.blocks == events_on().blocks and state.cached == {}


def test_nothing_with_events_off_or_no_blocks() -> None:
    assert emit_cached_block_events(events_on(), REQ, 0, 1, 0)[0] == events_on()
    quiet = new_pool(4)
    assert emit_cached_block_events(quiet, REQ, 2, 1, 0)[0] == quiet


def test_lookahead_tokens_and_medium_come_from_the_pool() -> None:
    pool = new_pool(4, enable_events=True, medium="CPU", num_hash_lookahead_tokens=2)
    state, _ = emit_cached_block_events(pool, REQ, 2, 1, 0)
    (event,) = state.pending_events
    assert isinstance(event, BlockStored)
    assert event.medium == "CPU"
    assert event.lookahead_token_ids == ((11, 12), (12, 13))
    assert event.block_hashes == (H0, H1) and H2 not in event.block_hashes
