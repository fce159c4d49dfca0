"""kvpool.impl.BlockPool, operation by operation."""

from typing import Any

import pytest

from kvpool import model
from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import (
    APPEND,
    HASHLESS_FIRST,
    HASHLESS_FIRST_APPEND_UNCACHED,
    AllBlocksCleared,
    AlreadyCached,
    BlockNotHeld,
    BlockRemoved,
    BlockStored,
    CacheRequest,
    CachingDisabled,
    DuplicateBlock,
    InvalidArgument,
    InvalidBlockCount,
    InvalidBlockMask,
    InvalidBlockRange,
    InvalidBlockSize,
    InvalidConfig,
    InvalidGroup,
    InvalidPartialBlock,
    NotEnoughFreeBlocks,
    NotEnoughHashes,
    OverFree,
    UnknownBlock,
)
from tests.impl.helpers import REQ, LoraRequest, VllmStyleRequest, assert_rejected, ids, queue_ids

# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def test_new_pool_matches_the_model_and_hides_the_null_block() -> None:
    pool = BlockPool(5, True, 2, profile=APPEND)
    assert pool.snapshot() == model.new_pool(5, True, 2, profile=APPEND)
    assert queue_ids(pool) == [1, 2, 3, 4]
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.free_block_queue.num_free_blocks == 4
    pool.check_invariants()


def test_a_one_block_pool_has_nothing_to_hand_out() -> None:
    pool = BlockPool(1, True, 1)
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 0.0
    assert pool.get_new_blocks(0) == []
    pool.check_invariants()


@pytest.mark.parametrize(("num_blocks", "hash_block_size"), [(0, 1), (-2, 1), (3, 0), (3, -1)])
def test_invalid_config_is_rejected(num_blocks: int, hash_block_size: int) -> None:
    with pytest.raises(InvalidConfig):
        BlockPool(num_blocks, True, hash_block_size)


def test_positional_signature_is_vllms() -> None:
    pool = BlockPool(4, True, 1, True, None, 3, "CPU")
    assert pool.enable_kv_cache_events and pool.hash_block_size == 1
    assert pool.num_hash_lookahead_tokens == 3 and pool.medium == "CPU"


def test_optional_arguments_default_as_in_vllm() -> None:
    pool = BlockPool(4, True, 1)
    assert not pool.enable_kv_cache_events and pool.metrics_collector is None
    assert pool.num_hash_lookahead_tokens == 0 and pool.medium == "GPU"


def test_negative_lookahead_is_rejected() -> None:
    with pytest.raises(InvalidConfig, match="num_hash_lookahead_tokens"):
        BlockPool(4, True, 1, num_hash_lookahead_tokens=-1)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_bool_lookahead_is_kept_as_the_int_it_stands_for(lookahead: bool) -> None:
    """vLLM's callers pass EAGLE's one look-ahead token as a bool; the pool keeps the int
    (the model's config holds no bool, and ``True == 1`` alone would hide the difference)."""
    pool = BlockPool(3, True, 1, num_hash_lookahead_tokens=lookahead)
    assert pool.snapshot() == model.new_pool(3, num_hash_lookahead_tokens=int(lookahead))
    assert type(pool.num_hash_lookahead_tokens) is int
    assert type(pool.snapshot().config.num_hash_lookahead_tokens) is int


# --------------------------------------------------------------------------
# get_new_blocks
# --------------------------------------------------------------------------


def test_get_new_blocks_hands_out_the_front_held_once() -> None:
    pool = BlockPool(5, True, 1)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert queue_ids(pool) == [4]
    pool.check_invariants()


def test_get_new_blocks_evicts_every_key_primary_first() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(REQ, [block], 0, 1, 1, 0)
    pool.cache_partial_block(CacheRequest((b"p",)), block, 1, 1, 2)
    pool.cache_partial_block(CacheRequest((b"q",)), block, 1, 2, 2)
    pool.free_blocks([block])
    pool.take_events()
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.take_events() == [
        BlockRemoved((b"h0",), "GPU", 0),
        BlockRemoved((b"p",), "GPU", 1),
        BlockRemoved((b"q",), "GPU", 2),
    ]
    assert block.block_hash is None and pool.get_cached_block(b"h0", [0]) is None
    pool.check_invariants()


def test_get_new_blocks_rejects_negative_and_too_many() -> None:
    pool = BlockPool(3, True, 1)
    assert_rejected(pool, InvalidBlockCount, pool.get_new_blocks, -1)
    assert_rejected(pool, NotEnoughFreeBlocks, pool.get_new_blocks, 3)
    assert issubclass(NotEnoughFreeBlocks, ValueError)


# --------------------------------------------------------------------------
# touch
# --------------------------------------------------------------------------


def test_touch_takes_a_free_cached_block_out_of_the_queue_with_its_hash() -> None:
    pool = BlockPool(4, True, 1)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    pool.free_blocks(blocks[::-1])
    assert queue_ids(pool) == [3, 2, 1]
    pool.touch([blocks[0], blocks[0], pool.null_block])
    assert blocks[0].ref_cnt == 2 and blocks[0].block_hash == (b"h0", 0)
    assert queue_ids(pool) == [3, 2]
    assert pool.null_block.ref_cnt == 0
    pool.check_invariants()


def test_touch_rejects_blocks_of_no_pool_before_touching_any() -> None:
    pool = BlockPool(4, True, 1)
    assert_rejected(pool, UnknownBlock, pool.touch, [pool.blocks[1], KVCacheBlock(9)])
    assert_rejected(pool, UnknownBlock, pool.touch, [pool.blocks[1], KVCacheBlock(-1)])
    # A block of another pool with an id this pool has is not this pool's block either.
    other = BlockPool(4, True, 1)
    assert_rejected(pool, UnknownBlock, pool.touch, [pool.blocks[1], other.blocks[2]])
    fake_head = pool.free_block_queue.fake_free_list_head
    assert_rejected(pool, UnknownBlock, pool.touch, [fake_head])


def test_a_rejected_touch_relinks_every_block_where_it_was() -> None:
    pool = BlockPool(8, True, 1)
    held = pool.get_new_blocks(2)
    pool.free_blocks(held)
    # Queue: [1, 2, 3, 4, 5, 6, 7]; take out neighbours, the front, the back, repeats.
    b = pool.blocks
    touched = [b[1], b[3], b[2], b[1], b[7], pool.null_block, b[4], KVCacheBlock(3)]
    assert_rejected(pool, UnknownBlock, pool.touch, touched)
    assert queue_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    # Neighbours taken out in either order are put back exactly.
    assert_rejected(pool, UnknownBlock, pool.touch, [b[2], b[3], b[4], KVCacheBlock(1)])
    assert_rejected(pool, UnknownBlock, pool.touch, [b[4], b[3], b[2], KVCacheBlock(1)])
    assert queue_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    pool.touch(touched[:-1])
    assert queue_ids(pool) == [5, 6]
    assert [x.ref_cnt for x in b] == [0, 2, 1, 1, 1, 0, 0, 1]


# --------------------------------------------------------------------------
# free_blocks
# --------------------------------------------------------------------------


def _queue_after_mixed_free(profile: model.Profile, caching: bool) -> list[int]:
    """Free [null, 6, 5, 4, 3, 2, 1] with 1 and 3 hashed onto the queue [7, 8, 9]."""
    pool = BlockPool(10, caching, 1, profile=profile)
    blocks = pool.get_new_blocks(6)
    if caching:
        pool.cache_full_blocks(REQ, blocks, 0, 1, 1, 0)
        pool.cache_full_blocks(REQ, [blocks[1], blocks[2]], 1, 2, 1, 0)
    pool.free_blocks([pool.null_block, *blocks[::-1]])
    pool.check_invariants()
    return queue_ids(pool)


def test_free_order_follows_the_profile() -> None:
    assert _queue_after_mixed_free(HASHLESS_FIRST, True) == [6, 5, 4, 2, 7, 8, 9, 3, 1]
    assert _queue_after_mixed_free(APPEND, True) == [7, 8, 9, 6, 5, 4, 3, 2, 1]
    assert _queue_after_mixed_free(HASHLESS_FIRST_APPEND_UNCACHED, False) == [
        7,
        8,
        9,
        6,
        5,
        4,
        3,
        2,
        1,
    ]
    assert _queue_after_mixed_free(HASHLESS_FIRST, False) == [6, 5, 4, 3, 2, 1, 7, 8, 9]


def test_free_blocks_accepts_any_iterable_and_releases_repeats() -> None:
    pool = BlockPool(4, True, 1)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    pool.free_blocks(iter([a, b, a]))
    # b reached zero before a did, so b is ahead of a.
    assert queue_ids(pool) == [b.block_id, a.block_id, 3]
    pool.check_invariants()


@pytest.mark.parametrize("profile", [HASHLESS_FIRST, APPEND])
def test_a_rejected_free_undoes_the_blocks_it_had_already_linked(profile: model.Profile) -> None:
    pool = BlockPool(6, True, 1, profile=profile)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks(REQ, [b], 0, 1, 1, 0)
    # a and b reach zero (and are linked) before the second a over-frees.
    assert_rejected(pool, OverFree, pool.free_blocks, [a, b, c, a])
    assert_rejected(pool, BlockNotHeld, pool.free_blocks, [a, b, pool.blocks[4]])
    assert_rejected(pool, UnknownBlock, pool.free_blocks, [a, b, KVCacheBlock(99)])
    assert_rejected(pool, UnknownBlock, pool.free_blocks, [a, a, KVCacheBlock(99)])


@pytest.mark.parametrize("caching", [True, False])
def test_free_routes_blocks_of_another_pool_to_it_after_its_own(caching: bool) -> None:
    """vLLM 0.33: each pool frees its own blocks, this one first, as two model calls would."""
    pool = BlockPool(5, caching, 1)
    other = BlockPool(5, caching, 1)
    mine_a, mine_b = pool.get_new_blocks(2)
    once, twice = other.get_new_blocks(2)
    other.touch([twice])
    expected_pool, _ = model.free_blocks(pool.snapshot(), [2, 1])
    expected_other, _ = model.free_blocks(other.snapshot(), [2, 1])
    pool.free_blocks([mine_b, twice, mine_a, once])
    assert pool.snapshot() == expected_pool
    assert other.snapshot() == expected_other
    pool.check_invariants()
    other.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_free_of_another_pools_block_it_does_not_hold_changes_neither_pool(caching: bool) -> None:
    pool = BlockPool(5, caching, 1)
    other = BlockPool(5, caching, 1)
    (mine,) = pool.get_new_blocks(1)
    (once,) = other.get_new_blocks(1)
    before = other.snapshot()
    assert_rejected(pool, BlockNotHeld, pool.free_blocks, [mine, other.blocks[3]])
    assert_rejected(pool, OverFree, pool.free_blocks, [mine, once, once])
    assert_rejected(pool, UnknownBlock, pool.free_blocks, [mine, once, KVCacheBlock(2)])
    assert other.snapshot() == before


def test_free_errors_come_in_the_models_order() -> None:
    pool = BlockPool(6, True, 1)
    a, _ = pool.get_new_blocks(2)
    free = pool.blocks[4]
    # a is over-freed and `free` is not held: a is met first, so OverFree.
    assert_rejected(pool, OverFree, pool.free_blocks, [a, free, a])
    assert_rejected(pool, BlockNotHeld, pool.free_blocks, [free, a, a])
    # An unknown block anywhere wins.
    assert_rejected(pool, UnknownBlock, pool.free_blocks, [a, free, a, KVCacheBlock(-5)])


# --------------------------------------------------------------------------
# cache_full_blocks
# --------------------------------------------------------------------------


def test_cache_full_blocks_keys_blocks_by_prefix_and_skips_null_and_masked() -> None:
    pool = BlockPool(6, True, 1)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks(REQ, [a, pool.null_block, b, c], 0, 4, 1, 2, [True, True, True, False])
    assert a.block_hash == (b"h0", 2) and a.block_hash_num_tokens == 1
    assert pool.null_block.block_hash is None
    assert b.block_hash == (b"h2", 2) and b.block_hash_num_tokens == 3
    assert c.block_hash is None
    pool.check_invariants()


def test_cache_full_blocks_with_a_block_size_of_several_hash_blocks_takes_every_kth_hash() -> None:
    pool = BlockPool(4, True, 1)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, [a, b], 0, 2, 2, 0)
    assert a.block_hash == (b"h1", 0) and b.block_hash == (b"h3", 0)
    assert b.block_hash_num_tokens == 4


class Count(int):
    """An int of a subclass (as an IntEnum or a numpy-free wrapper would pass)."""


def test_get_new_blocks_cache_full_blocks_and_get_cached_block_take_ints_of_a_subclass() -> None:
    # All three run again on plain ints when handed a subclass (impl/pool.py): same result.
    pool = BlockPool(6, True, 1, enable_kv_cache_events=True)
    plain = BlockPool(6, True, 1, enable_kv_cache_events=True)
    for target, n in ((pool, Count), (plain, int)):
        blocks = target.get_new_blocks(n(3))
        target.cache_full_blocks(REQ, blocks, n(0), n(3), n(1), n(2), [True, False, True])
        assert ids(target.get_cached_block(b"h2", [n(2)])) == [blocks[2].block_id]
        assert_rejected(target, InvalidGroup, target.get_cached_block, b"h2", [n(-1)])
    assert pool.snapshot() == plain.snapshot()
    pool.check_invariants()


def test_duplicate_keys_stay_side_by_side_and_the_first_is_found() -> None:
    pool = BlockPool(6, True, 1)
    a, b, c = pool.get_new_blocks(3)
    for block in (a, b, c):
        pool.cache_full_blocks(REQ, [block], 0, 1, 1, 0)
    assert ids(pool.get_cached_block(b"h0", [0])) == [a.block_id]
    pool.evict_blocks({a.block_id})
    assert ids(pool.get_cached_block(b"h0", [0])) == [b.block_id]
    pool.cache_full_blocks(REQ, [a], 0, 1, 1, 0)
    assert ids(pool.get_cached_block(b"h0", [0])) == [b.block_id]
    pool.evict_blocks({b.block_id, c.block_id})
    assert ids(pool.get_cached_block(b"h0", [0])) == [a.block_id]
    pool.check_invariants()


def test_cache_full_blocks_promotes_a_partial_entry() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (block,) = pool.get_new_blocks(1)
    pool.cache_partial_block(REQ, block, 1, 0, 2)
    pool.take_events()
    pool.cache_full_blocks(REQ, [block], 0, 1, 2, 0)
    assert block.block_hash == (b"h1", 0) and block.block_hash_num_tokens == 2
    assert pool.take_events() == [
        BlockRemoved((b"h0",), "GPU", 0),
        BlockStored((b"h1",), None, (10, 11), 2, None, "GPU", None, (None,), 0),
    ]


def test_cache_full_blocks_event_reads_a_vllm_style_request() -> None:
    pool = BlockPool(4, True, 1, enable_kv_cache_events=True)
    a, b = pool.get_new_blocks(2)
    request = VllmStyleRequest([b"x", b"y", b"z"], [5, 6, 7], LoraRequest(7, "sql"))
    pool.cache_full_blocks(request, [a, b, pool.null_block], 1, 3, 1, 0)
    (event,) = pool.take_events()
    assert event == BlockStored(
        block_hashes=(b"y",),
        parent_block_hash=b"x",
        token_ids=(6, 7),
        block_size=1,
        lora_id=7,
        medium="GPU",
        lora_name="sql",
        extra_keys=(None,),
        group_idx=0,
    )


def test_cache_full_blocks_reads_the_models_lora_fields() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (a,) = pool.get_new_blocks(1)
    request = CacheRequest((b"x",), (1,), lora_id=3, lora_name="n")
    pool.cache_full_blocks(request, [a], 0, 1, 1, 0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored) and (event.lora_id, event.lora_name) == (3, "n")


def test_cache_full_blocks_with_only_masked_blocks_still_stores_an_empty_event() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(REQ, [a], 0, 1, 1, 0, [False])
    assert pool.take_events() == [
        BlockStored((), None, (10,), 1, None, "GPU", None, None, 0),
    ]


def test_cache_full_blocks_preconditions_in_the_models_order() -> None:
    pool = BlockPool(5, True, 2)
    a, b = pool.get_new_blocks(2)
    free = pool.blocks[3]
    stranger = KVCacheBlock(8)
    off = BlockPool(3, False, 2)
    assert_rejected(off, CachingDisabled, off.cache_full_blocks, REQ, [], 0, 0, 2, 0)
    assert_rejected(pool, InvalidGroup, pool.cache_full_blocks, REQ, [stranger], 0, 1, 3, -1)
    assert_rejected(pool, InvalidBlockSize, pool.cache_full_blocks, REQ, [a], 0, 1, 3, 0)
    assert_rejected(pool, InvalidBlockSize, pool.cache_full_blocks, REQ, [a], 0, 1, 1, 0)
    assert_rejected(pool, InvalidBlockRange, pool.cache_full_blocks, REQ, [a], -1, 1, 2, 0)
    assert_rejected(pool, InvalidBlockRange, pool.cache_full_blocks, REQ, [a], 0, 2, 2, 0)
    assert_rejected(pool, InvalidBlockMask, pool.cache_full_blocks, REQ, [a, b], 0, 2, 2, 0, [True])
    assert_rejected(pool, UnknownBlock, pool.cache_full_blocks, REQ, [a, stranger], 0, 2, 2, 0)
    assert_rejected(pool, NotEnoughHashes, pool.cache_full_blocks, REQ, [a, b], 0, 2, 6, 0)
    assert_rejected(pool, DuplicateBlock, pool.cache_full_blocks, REQ, [free, a, a], 0, 3, 2, 0)
    assert_rejected(pool, BlockNotHeld, pool.cache_full_blocks, REQ, [a, free], 0, 2, 2, 0)
    pool.cache_full_blocks(REQ, [a], 0, 1, 2, 0)
    assert_rejected(pool, AlreadyCached, pool.cache_full_blocks, REQ, [a, b], 0, 2, 2, 0)
    # The same block and prefix again, alone (a decode-step call): also AlreadyCached.
    assert_rejected(pool, AlreadyCached, pool.cache_full_blocks, REQ, [a], 0, 1, 2, 0)
    assert_rejected(pool, BlockNotHeld, pool.cache_full_blocks, REQ, [a, free], 1, 2, 2, 0)
    # An empty range validates its arguments and then does nothing.
    pool.cache_full_blocks(REQ, [a, b], 2, 1, 2, 0)
    assert_rejected(pool, InvalidBlockMask, pool.cache_full_blocks, REQ, [a], 1, 1, 2, 0, [True])


@pytest.mark.parametrize("mask", [None, [True, True, True]])
def test_cache_full_blocks_checks_every_hash_after_the_blocks(mask: list[bool] | None) -> None:
    """Several blocks, with and without a mask (two code paths): a hash that is not bytes
    is InvalidArgument, the null block's included, but a block's own error comes first."""
    pool = BlockPool(5, True, 2)
    a, b, c = pool.get_new_blocks(3)
    null = pool.null_block
    bad = CacheRequest(block_hashes=(b"h0", 7, b"h2", None), all_token_ids=(1, 2, 3, 4))  # type: ignore[arg-type]
    assert_rejected(pool, InvalidArgument, pool.cache_full_blocks, bad, [a, b, c], 0, 3, 2, 0, mask)
    assert_rejected(
        pool, InvalidArgument, pool.cache_full_blocks, bad, [a, null, c], 0, 3, 2, 0, mask
    )
    free = pool.blocks[4]
    assert_rejected(pool, BlockNotHeld, pool.cache_full_blocks, bad, [a, b, free], 0, 3, 2, 0, mask)
    assert_rejected(
        pool, DuplicateBlock, pool.cache_full_blocks, bad, [a, free, a], 0, 3, 2, 0, mask
    )
    pool.cache_full_blocks(REQ, [a, null, c], 0, 3, 2, 0, mask)
    assert [x.block_hash for x in (a, b, c)] == [(b"h0", 0), None, (b"h2", 0)]
    assert (a.block_hash_num_tokens, c.block_hash_num_tokens) == (2, 6)
    pool.check_invariants()


def test_cache_full_blocks_one_block_calls_reject_what_the_model_rejects() -> None:
    """The decode step's shape (one block, block = hash block, group 0, events off) has its
    own fast path in the impl: each way to get one of its inputs wrong, alone."""
    pool = BlockPool(6, True, 2)
    a, b = pool.get_new_blocks(2)
    other = BlockPool(4, True, 2)
    (foreign,) = other.get_new_blocks(1)
    stranger = KVCacheBlock(3, ref_cnt=1)
    free = pool.blocks[5]
    bad_hash = CacheRequest(block_hashes=(b"h0", 7), all_token_ids=(1, 2))  # type: ignore[arg-type]
    one_hash = CacheRequest(block_hashes=(b"h0",), all_token_ids=(1,))
    for blocks, stop, error in (
        ([a, foreign], 2, UnknownBlock),
        ([a, stranger], 2, UnknownBlock),
        ([a, "b"], 2, UnknownBlock),
        ([a, None], 2, UnknownBlock),
        ([a, free], 2, BlockNotHeld),
    ):
        assert_rejected(pool, error, pool.cache_full_blocks, REQ, blocks, stop - 1, stop, 2, 0)
    assert_rejected(pool, InvalidArgument, pool.cache_full_blocks, bad_hash, [a, b], 1, 2, 2, 0)
    assert_rejected(pool, NotEnoughHashes, pool.cache_full_blocks, one_hash, [a, b], 1, 2, 2, 0)
    no_hashes: list[Any] = [object(), VllmStyleRequest(None, [1]), VllmStyleRequest(7, [1])]  # type: ignore[arg-type]
    for request in no_hashes:
        assert_rejected(pool, InvalidArgument, pool.cache_full_blocks, request, [a, b], 1, 2, 2, 0)
    # Nothing to do: the null block, and a range that ends before it starts.
    before = pool.snapshot()
    pool.cache_full_blocks(REQ, [a, pool.null_block], 1, 2, 2, 0)
    pool.cache_full_blocks(REQ, [a, b], 1, 0, 2, 0)
    assert pool.snapshot() == before
    assert (foreign.ref_cnt, foreign.block_hash) == (1, None)
    other.check_invariants()
    # And the call itself: block 2 of the request gets the request's second hash.
    pool.cache_full_blocks(REQ, [a, b], 1, 2, 2, 0)
    assert (b.block_hash, b.block_hash_num_tokens, a.block_hash) == ((b"h1", 0), 4, None)
    pool.check_invariants()


def test_cache_full_blocks_one_block_calls_take_any_sequence_and_only_plain_ints() -> None:
    """The same one-block call with its arguments in other types: an iterator of blocks is
    read like a list; a float block size or group id is InvalidArgument, even one equal to
    the int it stands for."""
    pool = BlockPool(6, True, 2)
    a, b, c = pool.get_new_blocks(3)
    assert_rejected(pool, InvalidArgument, pool.cache_full_blocks, REQ, [a, b], 1, 2, 2.0, 0)
    assert_rejected(pool, InvalidArgument, pool.cache_full_blocks, REQ, [a, b], 1, 2, 2, 0.0)
    pool.cache_full_blocks(REQ, iter([a, b]), 1, 2, 2, 0)  # type: ignore[arg-type]
    pool.cache_full_blocks(REQ, (a, b, c), 2, 3, 2, 0)
    assert [x.block_hash for x in (a, b, c)] == [None, (b"h1", 0), (b"h2", 0)]
    pool.check_invariants()


@pytest.mark.parametrize("first_is_free", [True, False])
def test_cache_full_blocks_reports_the_first_of_two_bad_blocks(first_is_free: bool) -> None:
    """A free block and an already-cached block in one call: the error is the first one's."""
    pool = BlockPool(6, True, 2)
    cached, b = pool.get_new_blocks(2)
    # Keyed as the third block: 6 tokens, more than any position below asks for.
    pool.cache_full_blocks(REQ, [b, b, cached], 2, 3, 2, 0)
    free = pool.blocks[5]
    blocks = [b, free, cached] if first_is_free else [b, cached, free]
    error = BlockNotHeld if first_is_free else AlreadyCached
    assert_rejected(pool, error, pool.cache_full_blocks, REQ, blocks, 0, 3, 2, 0)
    # The same from a later start, with a mask (the general path's other branch).
    assert_rejected(pool, error, pool.cache_full_blocks, REQ, [b, *blocks], 1, 4, 2, 0, [True] * 3)


@pytest.mark.parametrize("mask", [None, "iterator"])
def test_cache_full_blocks_promotes_a_block_in_a_range_that_starts_later(mask: str | None) -> None:
    """Block y is keyed at 4 tokens, then cached at position 2 (6 tokens) by a call from
    block 2: a valid promotion, whether the mask comes as a list, an iterator or not at all."""
    pool = BlockPool(6, True, 2)
    x, y, z = pool.get_new_blocks(3)
    pool.cache_full_blocks(REQ, [x, y], 1, 2, 2, 0)
    assert y.block_hash_num_tokens == 4
    block_mask = None if mask is None else iter([True, True])
    pool.cache_full_blocks(REQ, [x, x, y, z], 2, 4, 2, 0, block_mask)  # type: ignore[arg-type]
    assert (y.block_hash, y.block_hash_num_tokens) == ((b"h2", 0), 6)
    assert (z.block_hash, z.block_hash_num_tokens) == ((b"h3", 0), 8)
    pool.check_invariants()


def test_cache_full_blocks_does_not_read_blocks_outside_the_range() -> None:
    """Only blocks[num_cached:num_full] are read, so a stranger before them is fine."""
    pool = BlockPool(4, True, 2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(REQ, [KVCacheBlock(9), b], 1, 2, 2, 0)
    assert b.block_hash is not None


# --------------------------------------------------------------------------
# cache_partial_block
# --------------------------------------------------------------------------


def test_cache_partial_block_primary_beside_repeat_and_promotion() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (block,) = pool.get_new_blocks(1)
    request = CacheRequest((b"a", b"b", b"c"), (1, 2, 3))
    assert pool.cache_partial_block(request, block, 2, 0, 3) == (b"b", 0)
    assert block.block_hash == (b"b", 0) and block.block_hash_num_tokens == 2
    # Fewer tokens than the primary key covers: a key beside it.
    assert pool.cache_partial_block(request, block, 1, 1, 3) == (b"a", 1)
    assert block.block_hash == (b"b", 0)
    events = pool.take_events()
    # The same key again: nothing happens.
    assert pool.cache_partial_block(request, block, 1, 1, 3) == (b"a", 1)
    assert pool.cache_partial_block(request, block, 2, 0, 3) == (b"b", 0)
    assert pool.take_events() == []
    assert events[1] == BlockStored((b"a",), None, (1,), 1, None, "GPU", None, (None,), 1)
    # More tokens than the primary key covers: promotion drops both keys first.
    assert pool.cache_partial_block(request, block, 3, 2, 4) == (b"c", 2)
    assert block.block_hash == (b"c", 2) and block.block_hash_num_tokens == 3
    assert pool.take_events() == [
        BlockRemoved((b"b",), "GPU", 0),
        BlockRemoved((b"a",), "GPU", 1),
        BlockStored((b"c",), b"b", (3,), 1, None, "GPU", None, (None,), 2),
    ]
    assert pool.get_cached_block(b"a", [1]) is None
    pool.check_invariants()


def test_cache_partial_block_promotes_to_a_longer_prefix() -> None:
    pool = BlockPool(3, True, 1, enable_kv_cache_events=True)
    (block,) = pool.get_new_blocks(1)
    request = CacheRequest((b"a", b"b", b"c"), (1, 2, 3))
    pool.cache_partial_block(request, block, 1, 0, 3)
    pool.take_events()
    assert pool.cache_partial_block(request, block, 2, 0, 3) == (b"b", 0)
    assert block.block_hash_num_tokens == 2
    assert pool.take_events() == [
        BlockRemoved((b"a",), "GPU", 0),
        BlockStored((b"b",), b"a", (2,), 1, None, "GPU", None, (None,), 0),
    ]


def test_cache_partial_block_on_the_null_block_returns_none() -> None:
    pool = BlockPool(3, True, 1)
    assert pool.cache_partial_block(REQ, pool.null_block, 99, 0, 1) is None


def test_cache_partial_block_preconditions_in_the_models_order() -> None:
    pool = BlockPool(4, True, 2)
    (a,) = pool.get_new_blocks(1)
    free = pool.blocks[2]
    off = BlockPool(3, False, 2)
    assert_rejected(off, CachingDisabled, off.cache_partial_block, REQ, off.blocks[1], 2, 0, 4)
    assert_rejected(pool, InvalidGroup, pool.cache_partial_block, REQ, KVCacheBlock(9), 2, -1, 4)
    assert_rejected(pool, UnknownBlock, pool.cache_partial_block, REQ, KVCacheBlock(9), 2, 0, 4)
    assert_rejected(pool, BlockNotHeld, pool.cache_partial_block, REQ, free, 2, 0, 3)
    assert_rejected(pool, InvalidBlockSize, pool.cache_partial_block, REQ, a, 2, 0, 2)
    assert_rejected(pool, InvalidBlockSize, pool.cache_partial_block, REQ, a, 2, 0, 5)
    assert_rejected(pool, InvalidPartialBlock, pool.cache_partial_block, REQ, a, 0, 0, 4)
    assert_rejected(pool, InvalidPartialBlock, pool.cache_partial_block, REQ, a, 3, 0, 4)
    assert_rejected(pool, InvalidPartialBlock, pool.cache_partial_block, REQ, a, 4, 0, 4)
    assert_rejected(pool, NotEnoughHashes, pool.cache_partial_block, REQ, a, 10, 0, 4)
    # Last: the hash the block would get is bytes (the block records it as bytes).
    not_bytes = CacheRequest(("h0",))  # type: ignore[arg-type]
    assert_rejected(pool, InvalidArgument, pool.cache_partial_block, not_bytes, a, 2, 0, 4)


@pytest.mark.parametrize(
    ("num_tokens", "group_id", "block_size"), [(True, 0, 2), (2, True, 4), (2, 0, 4.0)]
)
def test_cache_partial_block_takes_only_plain_ints_like_the_model(
    num_tokens: Any, group_id: Any, block_size: Any
) -> None:
    """A bool or a float that every later check would take (``True`` tokens in blocks of two
    hash blocks, group ``True``, a block size of ``4.0``) is refused by the type check, as the
    model refuses it, before the block gets a key."""
    hbs = 1 if block_size == 2 else 2
    pool = BlockPool(3, True, hbs)
    state, _ = model.get_new_blocks(model.new_pool(3, hash_block_size=hbs), 1)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(InvalidArgument):
        model.cache_partial_block(state, REQ, 1, num_tokens, group_id, block_size)
    assert_rejected(
        pool, InvalidArgument, pool.cache_partial_block, REQ, a, num_tokens, group_id, block_size
    )


# --------------------------------------------------------------------------
# get_cached_block, evict_blocks, reset_prefix_cache, events, queries
# --------------------------------------------------------------------------


def test_get_cached_block_needs_every_group() -> None:
    pool = BlockPool(4, True, 1)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, [a], 0, 1, 1, 0)
    pool.cache_full_blocks(REQ, [b], 0, 1, 1, 1)
    assert ids(pool.get_cached_block(b"h0", [1, 0])) == [b.block_id, a.block_id]
    assert pool.get_cached_block(b"h0", [0, 2]) is None
    assert pool.get_cached_block(b"h0", []) == []
    assert_rejected(pool, InvalidGroup, pool.get_cached_block, b"nope", [0, -1])


def test_evict_blocks_keeps_positions_and_reports_in_ascending_order() -> None:
    pool = BlockPool(5, True, 1, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(REQ, blocks, 0, 3, 1, 0)
    pool.free_blocks(blocks[:2])
    pool.take_events()
    before = queue_ids(pool)
    pool.evict_blocks({3, 1, 0})
    assert queue_ids(pool) == before
    assert pool.take_events() == [
        BlockRemoved((b"h0",), "GPU", 0),
        BlockRemoved((b"h2",), "GPU", 0),
    ]
    assert blocks[2].ref_cnt == 1 and blocks[2].block_hash is None
    assert_rejected(pool, UnknownBlock, pool.evict_blocks, {2, 5})
    assert_rejected(pool, UnknownBlock, pool.evict_blocks, {-1, 2})
    pool.evict_blocks(set())
    pool.check_invariants()


@pytest.mark.parametrize("kind", [list, tuple, set, frozenset, iter])
def test_evict_blocks_takes_any_iterable_of_ids(kind: Any) -> None:
    pool = BlockPool(4, True, 1, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    pool.take_events()
    pool.evict_blocks(kind([2, 1, 2]))
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.take_events() == [
        BlockRemoved((b"h0",), "GPU", 0),
        BlockRemoved((b"h1",), "GPU", 0),
    ]


def test_evict_blocks_takes_ids_of_an_int_subclass_like_the_model() -> None:
    pool = BlockPool(4, True, 1)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    expected, _ = model.evict_blocks(pool.snapshot(), [Count(2)])
    pool.evict_blocks([Count(2)])
    assert pool.snapshot() == expected
    assert blocks[1].block_hash is None and blocks[0].block_hash == (b"h0", 0)


def test_evict_blocks_reports_a_repeated_id_to_the_collector_once() -> None:
    """The ids are a set (vLLM's ``evict_blocks(block_ids: set[int])``): listed twice, a
    block is evicted, and reported, once."""
    recorder = Recorder()
    pool = BlockPool(3, True, 1, metrics_collector=recorder)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(REQ, [a], 0, 1, 1, 0)
    recorder.calls.clear()
    pool.evict_blocks([1, 2, 1])
    assert sorted(recorder.calls) == [("evicted", 1), ("evicted", 2)]


def test_reset_prefix_cache_refuses_while_held_and_clears_otherwise() -> None:
    pool = BlockPool(4, True, 1, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    pool.cache_partial_block(REQ, blocks[1], 1, 1, 2)
    pool.take_events()
    before = pool.snapshot()
    assert pool.reset_prefix_cache() is False
    assert pool.snapshot() == before
    pool.free_blocks(blocks)
    order = queue_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(b"h0", [0]) is None
    assert queue_ids(pool) == order
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_invariants()


def test_reset_prefix_cache_clears_every_block_under_a_duplicate_key() -> None:
    pool = BlockPool(4, True, 1)
    a, b = pool.get_new_blocks(2)
    for block in (a, b):
        pool.cache_full_blocks(REQ, [block], 0, 1, 1, 0)
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache() is True
    assert [blk.block_hash for blk in (a, b)] == [None, None]
    pool.check_invariants()


def test_events_off_means_no_events() -> None:
    pool = BlockPool(3, True, 1)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    assert pool.take_events() == [] and pool.kv_event_queue == []


def test_usage_counts_held_blocks_without_the_null_block() -> None:
    pool = BlockPool(5, True, 1)
    pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    assert pool.get_num_free_blocks() == 3


def test_a_scenario_snapshot_equals_the_models_state() -> None:
    pool = BlockPool(6, True, 1, enable_kv_cache_events=True)
    state = model.new_pool(6, enable_events=True)
    blocks = pool.get_new_blocks(3)
    state, got = model.get_new_blocks(state, 3)
    pool.cache_full_blocks(REQ, blocks, 0, 3, 1, 0)
    state, _ = model.cache_full_blocks(state, REQ, got, 0, 3, 1, 0)
    pool.free_blocks(blocks[::-1])
    state, _ = model.free_blocks(state, got[::-1])
    hit = pool.get_cached_block(b"h1", [0])
    assert hit is not None
    pool.touch(hit)
    state, _ = model.touch(state, [2])
    assert pool.snapshot() == state


class Recorder:
    """A metrics collector that records the hooks called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.calls.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.calls.append(("reset", None))


def test_metrics_collector_hooks_are_called() -> None:
    recorder = Recorder()
    pool = BlockPool(3, True, 1, metrics_collector=recorder)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a, pool.null_block])
    pool.free_blocks([a, a])
    pool.evict_blocks({1})
    pool.reset_prefix_cache()
    assert recorder.calls == [
        ("evicted", 1),
        ("allocated", 1),
        ("accessed", 1),
        ("evicted", 1),
        ("reset", None),
    ]


def test_maybe_evict_cached_block_reports_the_eviction_with_or_without_a_key() -> None:
    """vLLM's ``_maybe_evict_cached_block`` tells the collector first, whether or not the
    block carries a key (vllm/v1/core/block_pool.py, 0.33.0)."""
    recorder = Recorder()
    pool = BlockPool(3, True, 1, metrics_collector=recorder)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, [a], 0, 1, 1, 0)
    recorder.calls.clear()
    assert pool._maybe_evict_cached_block(a) is True
    assert pool._maybe_evict_cached_block(b) is False
    assert recorder.calls == [("evicted", 1), ("evicted", 2)]
