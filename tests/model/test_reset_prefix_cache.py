"""reset_prefix_cache: forget every hash, but only when no block is held."""

from typing import Any

from kvpool.model import (
    AllBlocksCleared,
    BlockState,
    CacheRequest,
    PoolState,
    cache_partial_block,
    free_blocks,
    get_new_blocks,
    new_pool,
    reset_prefix_cache,
    take_events,
    touch,
)
from tests.model.helpers import cached, held


def all_free_cached(**pool_args: Any) -> PoolState:
    state, _ = free_blocks(cached(5, 3, **pool_args), [2, 3, 1])
    return state


def test_refused_while_a_block_is_held_and_the_state_is_unchanged() -> None:
    def build() -> PoolState:
        state, _ = touch(all_free_cached(enable_events=True), [2])
        return state

    state = build()
    after, ok = reset_prefix_cache(state)
    assert ok is False
    assert after is state
    assert after == build()


def test_refused_while_every_block_is_held() -> None:
    state = held(3, 2)
    after, ok = reset_prefix_cache(state)
    assert ok is False
    assert after == held(3, 2)


def test_clears_every_hash_when_every_block_is_free() -> None:
    state, ok = reset_prefix_cache(all_free_cached())
    assert ok is True
    assert state.blocks == tuple(BlockState() for _ in range(5))
    assert dict(state.cached) == {}


def test_keeps_the_free_queue_order() -> None:
    before = all_free_cached()
    assert before.free_queue == (4, 2, 3, 1)
    state, _ = reset_prefix_cache(before)
    assert state.free_queue == (4, 2, 3, 1)


def test_clears_partial_keys_too() -> None:
    request = CacheRequest((b"p2", b"p4"))
    state, _ = get_new_blocks(new_pool(2, hash_block_size=2), 1)
    state, _ = cache_partial_block(state, request, 1, 4, 0, 6)
    state, _ = cache_partial_block(state, request, 1, 2, 0, 6)
    state, _ = free_blocks(state, [1])
    state, ok = reset_prefix_cache(state)
    assert ok is True
    assert state.blocks[1] == BlockState()
    assert dict(state.cached) == {}


def test_emits_a_single_all_cleared_event_and_no_removals() -> None:
    state, _ = take_events(all_free_cached(enable_events=True))
    state, _ = reset_prefix_cache(state)
    assert state.pending_events == (AllBlocksCleared(),)


def test_succeeds_on_a_fresh_pool_and_still_emits_all_cleared() -> None:
    state, ok = reset_prefix_cache(new_pool(3, enable_events=True))
    assert ok is True
    assert state.pending_events == (AllBlocksCleared(),)


def test_no_event_when_events_are_disabled() -> None:
    state, ok = reset_prefix_cache(all_free_cached())
    assert ok is True
    assert state.pending_events == ()


def test_succeeds_on_a_pool_without_caching() -> None:
    state = held(3, 2, enable_caching=False)
    state, _ = free_blocks(state, [1, 2])
    after, ok = reset_prefix_cache(state)
    assert ok is True
    assert after == state


def test_single_block_pool_can_always_be_reset() -> None:
    state, ok = reset_prefix_cache(new_pool(1))
    assert ok is True
    assert state == new_pool(1)
