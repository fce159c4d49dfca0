"""take_events: every event queued since the last call, oldest first; the queue is emptied."""

from kvpool.model import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    evict_blocks,
    free_blocks,
    new_pool,
    reset_prefix_cache,
    take_events,
)
from tests.model.helpers import H0, H1, cached


def test_fresh_pool_has_no_events() -> None:
    state, events = take_events(new_pool(3, enable_events=True))
    assert events == ()
    assert state == new_pool(3, enable_events=True)


def test_returns_every_pending_event_oldest_first_and_empties_the_queue() -> None:
    state = cached(3, 2, enable_events=True)
    state, _ = evict_blocks(state, {2})
    state, _ = free_blocks(state, [1, 2])
    state, _ = reset_prefix_cache(state)
    state, events = take_events(state)
    assert events == (
        BlockStored((H0, H1), None, (10, 11), 1, None, MEDIUM_GPU, None, (None, None), 0),
        BlockRemoved((H1,), MEDIUM_GPU, 0),
        AllBlocksCleared(),
    )
    assert state.pending_events == ()


def test_a_second_call_returns_nothing() -> None:
    state, first = take_events(cached(3, 1, enable_events=True))
    assert len(first) == 1
    state, second = take_events(state)
    assert second == ()


def test_only_the_event_queue_changes() -> None:
    state = cached(3, 2, enable_events=True)
    after, _ = take_events(state)
    assert after.blocks == state.blocks
    assert after.free_queue == state.free_queue
    assert dict(after.cached) == dict(state.cached)
    assert after.config == state.config


def test_events_disabled_always_returns_nothing() -> None:
    state, events = take_events(cached(3, 2))
    assert events == ()
    assert state == cached(3, 2)


def test_events_after_a_take_start_a_new_batch() -> None:
    state, _ = take_events(cached(3, 2, enable_events=True))
    state, _ = free_blocks(state, [1, 2])
    state, _ = reset_prefix_cache(state)
    state, events = take_events(state)
    assert events == (AllBlocksCleared(),)
