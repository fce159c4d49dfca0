"""touch: one more reference per block, a cache hit by another request."""

from kvpool.model import (
    BlockState,
    UnknownBlock,
    free_blocks,
    get_new_blocks,
    new_pool,
    touch,
)
from tests.model.helpers import H0, H1, assert_rejected, cached, held

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_negative_block_id() -> None:
    assert_rejected(lambda: held(4, 1), UnknownBlock, touch, [2, -1])


def test_invalid_block_id_equal_to_the_pool_size() -> None:
    assert_rejected(lambda: held(4, 1), UnknownBlock, touch, [1, 4])


def test_invalid_unknown_id_after_valid_free_ids_touches_none_of_them() -> None:
    assert_rejected(lambda: new_pool(4), UnknownBlock, touch, [1, 2, 99])


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_touching_a_free_block_removes_it_from_the_queue_and_holds_it() -> None:
    state, _ = touch(new_pool(4), [2])
    assert state.free_queue == (1, 3)
    assert state.blocks[2] == BlockState(ref_cnt=1)


def test_touching_a_held_block_adds_a_reference_and_leaves_the_queue() -> None:
    state, _ = touch(held(4, 1), [1])
    assert state.free_queue == (2, 3)
    assert state.blocks[1].ref_cnt == 2


def test_touching_a_cached_free_block_keeps_its_hash_and_map_entry() -> None:
    state = cached(4, 2)
    state, _ = free_blocks(state, [2, 1])
    assert state.free_queue == (3, 2, 1)
    state, _ = touch(state, [1])
    assert state.free_queue == (3, 2)
    assert state.blocks[1] == BlockState(ref_cnt=1, block_hash=(H0, 0), hash_num_tokens=1)
    assert dict(state.cached) == {(H0, 0): (1,), (H1, 0): (2,)}


def test_touching_a_block_twice_in_one_call_adds_two_references() -> None:
    state, _ = touch(new_pool(4), [3, 3])
    assert state.free_queue == (1, 2)
    assert state.blocks[3].ref_cnt == 2


def test_touching_several_blocks_removes_each_from_the_queue() -> None:
    state, _ = touch(new_pool(6), [4, 2])
    assert state.free_queue == (1, 3, 5)
    assert [b.ref_cnt for b in state.blocks] == [0, 0, 1, 0, 1, 0]


def test_the_null_block_is_skipped() -> None:
    state = held(3, 1)
    after, result = touch(state, [0, 0])
    assert result is None
    assert after == held(3, 1)
    assert after.blocks[0].ref_cnt == 0


def test_touching_nothing_changes_nothing() -> None:
    after, _ = touch(held(3, 1), [])
    assert after == held(3, 1)


def test_touch_emits_no_event() -> None:
    state = cached(3, 1, enable_events=True)
    state, _ = free_blocks(state, [1])
    before_events = state.pending_events
    state, _ = touch(state, [1])
    assert state.pending_events == before_events


def test_touched_block_is_no_longer_handed_out() -> None:
    state, _ = touch(new_pool(4), [1])
    state, ids = get_new_blocks(state, 2)
    assert ids == (2, 3)
