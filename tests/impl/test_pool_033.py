"""The fast pool's vLLM 0.33 operations, each against the model and with its rejections."""

from typing import Any

import pytest

from kvpool import model
from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import (
    AlreadyCached,
    BlockNotHeld,
    BlockStored,
    CacheRequest,
    InvalidArgument,
    InvalidBlockCount,
    InvalidBlockSize,
    InvalidPartialBlock,
    NotEnoughHashes,
    OverFree,
    UnknownBlock,
)
from tests.impl.helpers import REQ, assert_rejected, queue_ids


def cached_pool(n: int = 5, held: int = 2, **kwargs: Any) -> tuple[BlockPool, list[KVCacheBlock]]:
    pool = BlockPool(n, True, 1, **kwargs)
    blocks = pool.get_new_blocks(held)
    pool.cache_full_blocks(REQ, blocks, 0, held, 1, 0)
    return pool, blocks


def test_unpin_matches_the_model_and_the_watcher_sees_the_key_before_eviction() -> None:
    pool, (a, b) = cached_pool(4, 2, enable_kv_cache_events=True)
    seen: list[tuple[int, int, Any]] = []
    pool.unpin_blocks(
        [b, a], lambda block: seen.append((block.block_id, block.ref_cnt, block.block_hash))
    )
    expected, _ = model.unpin_blocks(
        cached_pool(4, 2, enable_kv_cache_events=True)[0].snapshot(), [2, 1], 0
    )
    assert queue_ids(pool) == list(expected.free_queue) == [3, 2, 1]
    pool.get_new_blocks(2)
    assert seen == [(2, 0, (b"h1", 0))]
    assert pool.snapshot().watchers.keys() == {1}
    pool.check_invariants()


def test_a_reset_fires_the_remaining_watchers_in_registration_order() -> None:
    pool, (a, b) = cached_pool(4, 2)
    seen: list[int] = []
    pool.unpin_blocks([b], lambda block: seen.append(block.block_id))
    pool.unpin_blocks([a], lambda block: seen.append(-block.block_id))
    assert pool.reset_prefix_cache()
    assert seen == [2, -1]
    assert pool.snapshot().watchers == {}


def test_a_watcher_that_raises_leaves_the_pool_as_it_was() -> None:
    pool, (a, _) = cached_pool(3, 2)

    def boom(block: KVCacheBlock) -> None:
        raise RuntimeError("reader gone")

    pool.unpin_blocks([a], boom)
    before = pool.snapshot()
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    assert pool.snapshot() == before
    pool.check_invariants()


def test_unpin_rejections() -> None:
    pool, (a, b) = cached_pool(5, 2)
    assert_rejected(pool, BlockNotHeld, pool.unpin_blocks, [a, pool.blocks[4]], print)
    assert_rejected(pool, BlockNotHeld, pool.unpin_blocks, [pool.null_block], print)
    assert_rejected(pool, OverFree, pool.unpin_blocks, [a, b, a], print)
    assert_rejected(pool, UnknownBlock, pool.unpin_blocks, [a, KVCacheBlock(1)], print)
    assert_rejected(pool, UnknownBlock, pool.unpin_blocks, [a, 3], print)
    assert_rejected(pool, InvalidArgument, pool.unpin_blocks, [a], "not callable")


def test_move_block_hashes_matches_the_model() -> None:
    pool, (a, _) = cached_pool(5, 2)
    (c,) = pool.get_new_blocks(1)
    expected, _ = model.move_block_hashes(pool.snapshot(), 1, 3)
    pool.move_block_hashes(a, c)
    assert pool.snapshot() == expected
    pool.check_invariants()


def test_move_block_hashes_lists_the_destination_last() -> None:
    pool = BlockPool(5, True, 1)
    a, b, c = pool.get_new_blocks(3)
    request = CacheRequest((b"k",), (1,))
    pool.cache_full_blocks(request, [a], 0, 1, 1, 0)
    pool.cache_full_blocks(request, [b], 0, 1, 1, 0)
    pool.move_block_hashes(a, c)
    assert pool.snapshot().cached == {(b"k", 0): (2, 3)}
    assert pool.get_cached_block(b"k", [0]) == [b]
    pool.check_invariants()


def test_move_block_hashes_rejections() -> None:
    pool, (a, b) = cached_pool(5, 2)
    assert_rejected(pool, BlockNotHeld, pool.move_block_hashes, a, pool.blocks[4])
    assert_rejected(pool, BlockNotHeld, pool.move_block_hashes, a, pool.null_block)
    assert_rejected(pool, AlreadyCached, pool.move_block_hashes, a, b)
    assert_rejected(pool, UnknownBlock, pool.move_block_hashes, a, KVCacheBlock(3))
    assert_rejected(pool, UnknownBlock, pool.move_block_hashes, None, b)


def test_is_block_writable_matches_the_model() -> None:
    pool, _ = cached_pool(5, 2)
    pool.get_new_blocks(1)
    state = pool.snapshot()
    for block in pool.blocks:
        assert pool.is_block_writable(block) == model.is_block_writable(state, block.block_id)
    assert_rejected(pool, UnknownBlock, pool.is_block_writable, KVCacheBlock(1))


def test_emit_cached_block_events_matches_the_model() -> None:
    for lookahead in (0, 2):
        pool = BlockPool(4, True, 1, True, num_hash_lookahead_tokens=lookahead, medium="CPU")
        state = pool.snapshot()
        pool.emit_cached_block_events(REQ, 2, 2, 1)
        expected, _ = model.emit_cached_block_events(state, REQ, 2, 2, 1)
        assert pool.snapshot() == expected
        assert_rejected(pool, NotEnoughHashes, pool.emit_cached_block_events, REQ, 3, 2, 0)
        assert_rejected(pool, InvalidBlockCount, pool.emit_cached_block_events, REQ, -1, 1, 0)


@pytest.mark.parametrize("events", [False, True])
def test_emit_cached_block_events_refuses_a_hash_that_is_not_bytes(events: bool) -> None:
    """Every announced hash must be bytes, as in the model, with events on or off; a hash
    past the announced blocks is not read."""
    request = CacheRequest((b"h0", "h1", "h2"), (1, 2, 3))  # type: ignore[arg-type]
    pool = BlockPool(4, True, 1, events)
    state = pool.snapshot()
    with pytest.raises(InvalidArgument):
        model.emit_cached_block_events(state, request, 2, 1, 0)
    assert_rejected(pool, InvalidArgument, pool.emit_cached_block_events, request, 2, 1, 0)
    pool.emit_cached_block_events(request, 1, 1, 0)
    expected, _ = model.emit_cached_block_events(state, request, 1, 1, 0)
    assert pool.snapshot() == expected


def test_lookahead_and_medium_reach_cache_full_blocks_events() -> None:
    pool = BlockPool(4, True, 1, True, num_hash_lookahead_tokens=1, medium="CPU")
    state = pool.snapshot()
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(REQ, blocks, 0, 2, 1, 0)
    state, _ = model.get_new_blocks(state, 2)
    state, _ = model.cache_full_blocks(state, REQ, [1, 2], 0, 2, 1, 0)
    assert pool.snapshot() == state
    stored = state.pending_events[-1]
    assert isinstance(stored, BlockStored)
    assert stored.lookahead_token_ids == ((11,), (12,))


def test_cache_partial_block_replacing_matches_the_model() -> None:
    request = CacheRequest((b"p2", b"p4"), (1, 2, 3, 4))
    pool = BlockPool(3, True, 2, True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [b], 0, 1, 4, 0)
    state = pool.snapshot()
    assert pool.cache_partial_block(request, b, 2, 0, 4, True) == (b"p2", 0)
    expected, _ = model.cache_partial_block(state, request, 1, 2, 0, 4, True)
    assert pool.snapshot() == expected
    assert_rejected(pool, InvalidArgument, pool.cache_partial_block, request, b, 2, 0, 4, 1)


def test_maybe_evict_cached_block_says_whether_it_dropped_a_key() -> None:
    pool, (a, _) = cached_pool(4, 2)
    expected, _ = model.evict_blocks(pool.snapshot(), [1])
    assert pool._maybe_evict_cached_block(a) is True
    assert pool.snapshot() == expected
    assert pool._maybe_evict_cached_block(a) is False


def test_not_strict_takes_what_vllm_032_takes_in_cache_partial_block() -> None:
    request = CacheRequest((b"p2", b"p4"), (1, 2, 3, 4))
    strict = BlockPool(3, True, 2)
    (b,) = strict.get_new_blocks(1)
    assert_rejected(strict, InvalidPartialBlock, strict.cache_partial_block, request, b, 4, 0, 4)
    assert_rejected(strict, InvalidBlockSize, strict.cache_partial_block, request, b, 2, 0, 2)
    lenient = BlockPool(3, True, 2, strict=False)
    (b,) = lenient.get_new_blocks(1)
    # An empty prefix is on a block boundary too, but it has no hash: refused in both modes
    # (read as hash number 0, it would key the block with the request's last hash).
    assert_rejected(lenient, InvalidPartialBlock, lenient.cache_partial_block, request, b, 0, 0, 4)
    # (and answers with the key in vLLM's shape: the hash, then the group in 4 bytes)
    assert lenient.cache_partial_block(request, b, 4, 0, 4) == b"p4\0\0\0\0"
    (c,) = lenient.get_new_blocks(1)
    assert lenient.cache_partial_block(request, c, 2, 0, 2) == b"p2\0\0\0\0"
    lenient.check_invariants()
