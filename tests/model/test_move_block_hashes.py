"""move_block_hashes: a block's keys move to a private copy, with no event (vLLM 0.33)."""

from kvpool.model import (
    AlreadyCached,
    BlockNotHeld,
    CacheRequest,
    PoolState,
    UnknownBlock,
    cache_full_blocks,
    cache_partial_block,
    get_cached_block,
    get_new_blocks,
    move_block_hashes,
    new_pool,
)
from tests.model.helpers import H0, H1, assert_rejected, cached


def two_sharing() -> PoolState:
    """Blocks 1 and 2 both under key (H0, 0), block 1 first; block 3 held and keyless."""
    state, _ = get_new_blocks(new_pool(5, enable_events=True), 3)
    request = CacheRequest((H0,), (10,))
    state, _ = cache_full_blocks(state, request, [1], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, request, [2], 0, 1, 1, 0)
    return state


# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_unknown_source() -> None:
    assert_rejected(lambda: cached(4, 2), UnknownBlock, move_block_hashes, 9, 2)


def test_invalid_unknown_destination() -> None:
    assert_rejected(lambda: cached(4, 2), UnknownBlock, move_block_hashes, 1, None)


def test_invalid_free_destination() -> None:
    assert_rejected(lambda: cached(4, 1), BlockNotHeld, move_block_hashes, 1, 2)


def test_invalid_null_destination() -> None:
    assert_rejected(lambda: cached(4, 1), BlockNotHeld, move_block_hashes, 1, 0)


def test_invalid_destination_with_a_key() -> None:
    assert_rejected(lambda: cached(4, 2), AlreadyCached, move_block_hashes, 1, 2)


def test_invalid_source_onto_itself_when_keyed() -> None:
    assert_rejected(lambda: cached(4, 1), AlreadyCached, move_block_hashes, 1, 1)


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_keys_move_with_their_token_count_and_no_event() -> None:
    state = two_sharing()
    events = state.pending_events
    state, _ = move_block_hashes(state, 1, 3)
    assert state.blocks[1].block_hash is None and state.blocks[1].hash_num_tokens is None
    assert state.blocks[3].block_hash == (H0, 0) and state.blocks[3].hash_num_tokens == 1
    assert state.pending_events == events
    assert state.blocks[1].ref_cnt == 1 and state.blocks[3].ref_cnt == 1


def test_the_destination_is_listed_last_so_the_other_sharer_is_found_first() -> None:
    state, _ = move_block_hashes(two_sharing(), 1, 3)
    assert dict(state.cached) == {(H0, 0): (2, 3)}
    assert get_cached_block(state, H0, [0]) == (2,)


def test_partial_keys_follow_the_primary_key() -> None:
    state, (a, b) = get_new_blocks(new_pool(4, hash_block_size=1), 2)
    request = CacheRequest((H0, H1), (10, 11))
    state, _ = cache_partial_block(state, request, a, 2, 0, 4)
    state, _ = cache_partial_block(state, request, a, 1, 1, 4)
    state, _ = move_block_hashes(state, a, b)
    assert state.blocks[b].block_hash == (H1, 0) and state.blocks[b].hash_num_tokens == 2
    assert state.blocks[b].partial_keys == ((H0, 1),)
    assert dict(state.cached) == {(H1, 0): (b,), (H0, 1): (b,)}


def test_a_source_without_keys_changes_nothing() -> None:
    state, _ = get_new_blocks(new_pool(4), 2)
    assert move_block_hashes(state, 1, 2)[0] == state
