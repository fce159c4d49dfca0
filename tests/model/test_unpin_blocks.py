"""unpin_blocks: release a block but keep reading it until the pool reuses it (vLLM 0.33)."""

from kvpool.model import (
    BlockNotHeld,
    InvalidArgument,
    OverFree,
    Reuse,
    UnknownBlock,
    free_blocks,
    get_new_blocks,
    reset_prefix_cache,
    take_reuses,
    touch,
    unpin_blocks,
)
from kvpool.model.pool import evict_blocks
from tests.model.helpers import H0, H1, assert_rejected, cached, held

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_unknown_block_id() -> None:
    assert_rejected(lambda: held(4, 1), UnknownBlock, unpin_blocks, [1, 7], "w")


def test_invalid_block_id_that_is_no_int() -> None:
    assert_rejected(lambda: held(4, 1), UnknownBlock, unpin_blocks, [1, "2"], "w")


def test_invalid_ids_that_are_no_list() -> None:
    assert_rejected(lambda: held(4, 1), InvalidArgument, unpin_blocks, 1, "w")


def test_invalid_unhashable_watcher() -> None:
    assert_rejected(lambda: held(4, 1), InvalidArgument, unpin_blocks, [1], ["w"])


def test_invalid_free_block() -> None:
    assert_rejected(lambda: held(4, 1), BlockNotHeld, unpin_blocks, [1, 2], "w")


def test_invalid_null_block() -> None:
    assert_rejected(lambda: held(4, 1), BlockNotHeld, unpin_blocks, [0], "w")


def test_invalid_block_listed_more_often_than_held() -> None:
    assert_rejected(lambda: held(4, 1), OverFree, unpin_blocks, [1, 1], "w")


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_unpinned_blocks_join_the_back_in_listed_order_hashed_or_not() -> None:
    state = cached(6, 1)  # block 1 cached, blocks 2..5 free
    state, _ = get_new_blocks(state, 1)  # block 2, no hash
    state, _ = unpin_blocks(state, [2, 1], "w")
    assert state.free_queue == (3, 4, 5, 2, 1)
    assert dict(state.watchers) == {2: "w", 1: "w"}
    assert state.pending_events == ()


def test_a_watcher_is_registered_even_while_the_block_stays_held() -> None:
    state, _ = touch(held(4, 1), [1])
    state, _ = unpin_blocks(state, [1], "w")
    assert state.blocks[1].ref_cnt == 1
    assert state.free_queue == (2, 3)
    assert dict(state.watchers) == {1: "w"}


def test_a_later_watcher_replaces_the_earlier_one_in_its_place() -> None:
    state, _ = touch(held(4, 2), [1, 2])
    state, _ = unpin_blocks(state, [1], "a")
    state, _ = unpin_blocks(state, [2], "b")
    state, _ = unpin_blocks(state, [1], "c")
    assert list(state.watchers.items()) == [(1, "c"), (2, "b")]


def test_the_watcher_fires_once_when_the_block_is_handed_out_with_its_key() -> None:
    state = cached(3, 2, enable_events=True)
    state, _ = unpin_blocks(state, [1], "w")
    state, _ = get_new_blocks(state, 1)
    assert state.pending_reuses == (Reuse("w", 1, (H0, 0)),)
    assert state.blocks[1].block_hash is None
    state, reuses = take_reuses(state)
    assert reuses == (Reuse("w", 1, (H0, 0)),)
    assert state.pending_reuses == () and dict(state.watchers) == {}


def test_touch_free_and_evict_fire_nothing_and_keep_the_watcher() -> None:
    state = cached(4, 2)
    state, _ = unpin_blocks(state, [1], "w")
    state, _ = touch(state, [1])
    state, _ = evict_blocks(state, [1])
    state, _ = free_blocks(state, [1])
    assert state.pending_reuses == ()
    assert dict(state.watchers) == {1: "w"}


def test_a_successful_reset_fires_every_watcher_in_registration_order() -> None:
    state = cached(4, 2)
    state, _ = unpin_blocks(state, [2], "b")
    state, _ = unpin_blocks(state, [1], "a")
    state, done = reset_prefix_cache(state)
    assert done
    assert state.pending_reuses == (Reuse("b", 2, (H1, 0)), Reuse("a", 1, (H0, 0)))
    assert dict(state.watchers) == {}


def test_a_refused_reset_fires_nothing() -> None:
    state = cached(4, 2)
    state, _ = unpin_blocks(state, [1], "a")
    state, done = reset_prefix_cache(state)
    assert not done
    assert state.pending_reuses == () and dict(state.watchers) == {1: "a"}


def test_unpin_blocks_with_caching_off_still_goes_to_the_back() -> None:
    state = held(4, 2, enable_caching=False)
    state, _ = unpin_blocks(state, [1], "w")
    state, _ = free_blocks(state, [2])
    assert state.free_queue == (2, 3, 1)
