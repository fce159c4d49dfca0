"""cache_partial_block: make a block reachable from a prefix that ends inside it."""

from typing import Any

from kvpool.model import (
    MEDIUM_GPU,
    BlockNotHeld,
    BlockRemoved,
    BlockState,
    BlockStored,
    CacheRequest,
    CachingDisabled,
    InvalidArgument,
    InvalidBlockSize,
    InvalidGroup,
    InvalidPartialBlock,
    NotEnoughHashes,
    PoolState,
    UnknownBlock,
    cache_full_blocks,
    cache_partial_block,
    get_new_blocks,
    new_pool,
)
from tests.model.helpers import Run, assert_rejected, held

P = CacheRequest(block_hashes=(b"p2", b"p4", b"p6"), all_token_ids=(1, 2, 3, 4, 5, 6))
"""A request hashed every 2 tokens: p2 names its first 2 tokens, p4 its first 4, p6 all 6."""


def one_held() -> PoolState:
    """hash_block_size 2, block 1 held."""
    return held(4, 1, hash_block_size=2)


def partial_at(num_tokens: int, block_size: int, **pool_args: Any) -> Run:
    run = Run(new_pool(3, hash_block_size=2, **pool_args))
    run.do(get_new_blocks, 1)
    run.do(cache_partial_block, P, 1, num_tokens, 0, block_size)
    return run


# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_caching_disabled() -> None:
    build = lambda: held(4, 1, hash_block_size=2, enable_caching=False)  # noqa: E731
    assert_rejected(build, CachingDisabled, cache_partial_block, P, 1, 2, 0, 4)


def test_invalid_negative_group() -> None:
    assert_rejected(one_held, InvalidGroup, cache_partial_block, P, 1, 2, -1, 4)


def test_invalid_negative_block_id() -> None:
    assert_rejected(one_held, UnknownBlock, cache_partial_block, P, -1, 2, 0, 4)


def test_invalid_block_id_equal_to_the_pool_size() -> None:
    assert_rejected(one_held, UnknownBlock, cache_partial_block, P, 4, 2, 0, 4)


def test_invalid_caching_a_free_block() -> None:
    assert_rejected(one_held, BlockNotHeld, cache_partial_block, P, 2, 2, 0, 4)


def test_invalid_block_size_equal_to_the_hash_block_size() -> None:
    assert_rejected(one_held, InvalidBlockSize, cache_partial_block, P, 1, 2, 0, 2)


def test_invalid_block_size_smaller_than_the_hash_block_size() -> None:
    assert_rejected(one_held, InvalidBlockSize, cache_partial_block, P, 1, 2, 0, 1)


def test_invalid_block_size_not_a_multiple_of_the_hash_block_size() -> None:
    assert_rejected(one_held, InvalidBlockSize, cache_partial_block, P, 1, 2, 0, 5)


def test_invalid_num_tokens_zero() -> None:
    assert_rejected(one_held, InvalidPartialBlock, cache_partial_block, P, 1, 0, 0, 4)


def test_invalid_num_tokens_negative() -> None:
    assert_rejected(one_held, InvalidPartialBlock, cache_partial_block, P, 1, -2, 0, 4)


def test_invalid_num_tokens_not_a_multiple_of_the_hash_block_size() -> None:
    assert_rejected(one_held, InvalidPartialBlock, cache_partial_block, P, 1, 3, 0, 4)


def test_invalid_num_tokens_a_multiple_of_the_block_size() -> None:
    assert_rejected(one_held, InvalidPartialBlock, cache_partial_block, P, 1, 4, 0, 4)


def test_invalid_not_enough_hashes() -> None:
    short = CacheRequest(block_hashes=(b"p2", b"p4"))
    assert_rejected(one_held, NotEnoughHashes, cache_partial_block, short, 1, 6, 0, 4)


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_hashless_block_gets_the_key_as_its_primary_key() -> None:
    state, key = cache_partial_block(one_held(), P, 1, 2, 0, 4)
    assert key == (b"p2", 0)
    assert state.blocks[1] == BlockState(ref_cnt=1, block_hash=(b"p2", 0), hash_num_tokens=2)
    assert dict(state.cached) == {(b"p2", 0): (1,)}
    assert state.free_queue == (2, 3)


def test_the_key_is_the_hash_at_num_tokens_in_the_given_group() -> None:
    state, key = cache_partial_block(one_held(), P, 1, 6, 3, 4)
    assert key == (b"p6", 3)
    assert state.blocks[1].hash_num_tokens == 6
    assert dict(state.cached) == {(b"p6", 3): (1,)}


def test_stored_event_covers_the_last_hash_block() -> None:
    run = partial_at(6, 8, enable_events=True)
    assert run.events() == (
        BlockStored((b"p6",), b"p4", (5, 6), 2, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_stored_event_for_the_first_hash_block_has_no_parent() -> None:
    request = CacheRequest((b"p2",), (1, 2), lora_id=5, lora_name="x")
    state, _ = get_new_blocks(new_pool(2, hash_block_size=2, enable_events=True), 1)
    state, _ = cache_partial_block(state, request, 1, 2, 1, 4)
    assert state.pending_events == (
        BlockStored((b"p2",), None, (1, 2), 2, 5, MEDIUM_GPU, "x", (None,), 1),
    )


def test_caching_the_same_key_again_changes_nothing_and_emits_nothing() -> None:
    run = partial_at(2, 4, enable_events=True)
    run.events()
    before = run.state
    key = run.do(cache_partial_block, P, 1, 2, 0, 4)
    assert key == (b"p2", 0)
    assert run.state == before
    assert run.events() == ()


def test_caching_a_key_already_beside_the_primary_changes_nothing_and_emits_nothing() -> None:
    run = partial_at(4, 8, enable_events=True)
    run.do(cache_partial_block, P, 1, 2, 0, 8)
    run.events()
    before = run.state
    key = run.do(cache_partial_block, P, 1, 2, 0, 8)
    assert key == (b"p2", 0)
    assert run.state == before
    assert run.events() == ()


def test_same_token_count_in_another_group_is_added_beside_not_promoted() -> None:
    run = partial_at(2, 4)
    key = run.do(cache_partial_block, P, 1, 2, 1, 4)
    assert key == (b"p2", 1)
    assert run.state.blocks[1] == BlockState(
        ref_cnt=1, block_hash=(b"p2", 0), hash_num_tokens=2, partial_keys=((b"p2", 1),)
    )
    assert dict(run.state.cached) == {(b"p2", 0): (1,), (b"p2", 1): (1,)}


def test_promotion_replaces_a_primary_key_covering_fewer_tokens() -> None:
    run = partial_at(2, 8, enable_events=True)
    run.events()
    key = run.do(cache_partial_block, P, 1, 4, 0, 8)
    assert key == (b"p4", 0)
    assert run.state.blocks[1] == BlockState(ref_cnt=1, block_hash=(b"p4", 0), hash_num_tokens=4)
    assert dict(run.state.cached) == {(b"p4", 0): (1,)}
    assert run.events() == (
        BlockRemoved((b"p2",), MEDIUM_GPU, 0),
        BlockStored((b"p4",), b"p2", (3, 4), 2, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_shorter_prefix_is_added_beside_the_primary_key() -> None:
    run = partial_at(4, 8, enable_events=True)
    run.events()
    key = run.do(cache_partial_block, P, 1, 2, 0, 8)
    assert key == (b"p2", 0)
    assert run.state.blocks[1] == BlockState(
        ref_cnt=1, block_hash=(b"p4", 0), hash_num_tokens=4, partial_keys=((b"p2", 0),)
    )
    assert dict(run.state.cached) == {(b"p4", 0): (1,), (b"p2", 0): (1,)}
    assert run.events() == (
        BlockStored((b"p2",), None, (1, 2), 2, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_shorter_prefix_beside_a_full_key_keeps_the_full_key_primary() -> None:
    request = CacheRequest((b"p2", b"p4"))
    state, (b,) = get_new_blocks(new_pool(2, hash_block_size=2), 1)
    state, _ = cache_full_blocks(state, request, [b], 0, 1, 4, 0)
    state, key = cache_partial_block(state, request, b, 2, 0, 4)
    assert key == (b"p2", 0)
    assert state.blocks[b] == BlockState(
        ref_cnt=1, block_hash=(b"p4", 0), hash_num_tokens=4, partial_keys=((b"p2", 0),)
    )


def test_promotion_drops_the_partial_keys_beside_the_primary_too() -> None:
    run = partial_at(4, 8, enable_events=True)
    run.do(cache_partial_block, P, 1, 2, 0, 8)
    run.events()
    run.do(cache_partial_block, P, 1, 6, 0, 8)
    assert run.state.blocks[1] == BlockState(ref_cnt=1, block_hash=(b"p6", 0), hash_num_tokens=6)
    assert dict(run.state.cached) == {(b"p6", 0): (1,)}
    assert run.events() == (
        BlockRemoved((b"p4",), MEDIUM_GPU, 0),
        BlockRemoved((b"p2",), MEDIUM_GPU, 0),
        BlockStored((b"p6",), b"p4", (5, 6), 2, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_same_key_on_a_second_block_is_listed_after_the_first() -> None:
    run = Run(new_pool(3, hash_block_size=2))
    run.do(get_new_blocks, 2)
    run.do(cache_partial_block, P, 2, 2, 0, 4)
    run.do(cache_partial_block, P, 1, 2, 0, 4)
    assert dict(run.state.cached) == {(b"p2", 0): (2, 1)}


def test_null_block_returns_none_and_changes_nothing() -> None:
    state = one_held()
    after, key = cache_partial_block(state, P, 0, 2, 0, 4)
    assert key is None
    assert after == one_held()


def test_null_block_is_not_checked_for_block_size_or_token_count() -> None:
    after, key = cache_partial_block(one_held(), P, 0, 4, 0, 2)
    assert key is None
    assert after == one_held()


def test_no_event_when_events_are_disabled() -> None:
    run = partial_at(2, 4)
    assert run.state.pending_events == ()


# --------------------------------------------------------------------------
# replace_existing_hashes (vLLM 0.33)
# --------------------------------------------------------------------------


def test_invalid_replace_flag_that_is_no_bool() -> None:
    assert_rejected(one_held, InvalidArgument, cache_partial_block, P, 1, 2, 0, 4, "yes")


def test_replacing_the_same_key_removes_and_stores_it_again() -> None:
    run = partial_at(2, 4, enable_events=True)
    run.events()
    key = run.do(cache_partial_block, P, 1, 2, 0, 4, True)
    assert key == (b"p2", 0)
    assert run.state.blocks[1] == BlockState(ref_cnt=1, block_hash=(b"p2", 0), hash_num_tokens=2)
    assert [type(e) for e in run.events()] == [BlockRemoved, BlockStored]


def test_replacing_can_demote_a_full_key_and_drops_every_partial_key() -> None:
    request = CacheRequest((b"p2", b"p4"), (1, 2, 3, 4))
    state, (b,) = get_new_blocks(new_pool(2, hash_block_size=2, enable_events=True), 1)
    state, _ = cache_full_blocks(state, request, [b], 0, 1, 4, 0)
    state, _ = cache_partial_block(state, request, b, 2, 1, 4)
    state, key = cache_partial_block(state, request, b, 2, 0, 4, True)
    assert key == (b"p2", 0)
    assert state.blocks[b] == BlockState(ref_cnt=1, block_hash=(b"p2", 0), hash_num_tokens=2)
    assert dict(state.cached) == {(b"p2", 0): (b,)}
    removed = [e for e in state.pending_events if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.group_idx) for e in removed] == [((b"p4",), 0), ((b"p2",), 1)]
    assert isinstance(state.pending_events[-1], BlockStored)
