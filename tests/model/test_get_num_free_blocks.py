"""get_num_free_blocks: the length of the free queue, eviction candidates included."""

from kvpool.model import (
    evict_blocks,
    free_blocks,
    get_new_blocks,
    get_num_free_blocks,
    new_pool,
    touch,
)
from tests.model.helpers import cached, held


def test_fresh_pool_has_every_block_but_the_null_block_free() -> None:
    assert get_num_free_blocks(new_pool(6)) == 5


def test_single_block_pool_has_nothing_free() -> None:
    assert get_num_free_blocks(new_pool(1)) == 0


def test_handing_out_blocks_lowers_the_count() -> None:
    assert get_num_free_blocks(held(6, 2)) == 3


def test_cached_free_blocks_are_counted_as_free() -> None:
    state, _ = free_blocks(cached(4, 2), [1, 2])
    assert get_num_free_blocks(state) == 3


def test_touching_a_free_block_lowers_the_count_touching_a_held_one_does_not() -> None:
    state, _ = touch(held(5, 1), [2])
    assert get_num_free_blocks(state) == 2
    state, _ = touch(state, [1, 2])
    assert get_num_free_blocks(state) == 2


def test_freeing_a_block_still_held_elsewhere_keeps_the_count() -> None:
    state, _ = touch(held(4, 1), [1])
    state, _ = free_blocks(state, [1])
    assert get_num_free_blocks(state) == 2


def test_eviction_from_the_cache_does_not_change_the_count() -> None:
    state, _ = free_blocks(cached(4, 2), [1])
    state, _ = evict_blocks(state, {1, 2})
    assert get_num_free_blocks(state) == 2


def test_taking_every_free_block_leaves_zero() -> None:
    state, _ = get_new_blocks(new_pool(4), 3)
    assert get_num_free_blocks(state) == 0
