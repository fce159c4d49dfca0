"""get_cached_block: the cached block for a hash in each group, or None on any miss."""

from kvpool.model import (
    InvalidGroup,
    PoolState,
    cache_full_blocks,
    evict_blocks,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    new_pool,
)
from tests.model.helpers import H0, H1, H2, REQ, assert_rejected, cached


def two_groups() -> PoolState:
    state, _ = get_new_blocks(new_pool(5), 2)
    state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, REQ, [2], 0, 1, 1, 1)
    return state


# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_negative_group() -> None:
    assert_rejected(lambda: cached(3, 1), InvalidGroup, get_cached_block, H0, [-1])


def test_invalid_negative_group_after_a_group_that_misses() -> None:
    # the miss in group 5 does not short-circuit the check of every group id
    assert_rejected(lambda: cached(3, 1), InvalidGroup, get_cached_block, H0, [5, -1])


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_miss_on_an_empty_pool() -> None:
    assert get_cached_block(new_pool(3), H0, [0]) is None


def test_hit_returns_the_block_of_the_group() -> None:
    state = cached(4, 3)
    assert get_cached_block(state, H1, [0]) == (2,)


def test_hash_cached_in_another_group_is_a_miss() -> None:
    assert get_cached_block(cached(3, 1, group=1), H0, [0]) is None


def test_hit_in_every_group_returns_one_block_per_group_in_the_order_asked() -> None:
    state = two_groups()
    assert get_cached_block(state, H0, [0, 1]) == (1, 2)
    assert get_cached_block(state, H0, [1, 0]) == (2, 1)


def test_a_miss_in_any_group_is_a_miss() -> None:
    assert get_cached_block(two_groups(), H0, [0, 1, 2]) is None


def test_no_groups_is_an_empty_hit() -> None:
    assert get_cached_block(new_pool(2), H0, []) == ()


def test_duplicates_return_the_block_inserted_first() -> None:
    state, _ = get_new_blocks(new_pool(4), 2)
    state, _ = cache_full_blocks(state, REQ, [2], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, REQ, [1], 0, 1, 1, 0)
    assert get_cached_block(state, H0, [0]) == (2,)


def test_a_free_cached_block_is_still_a_hit() -> None:
    state, _ = free_blocks(cached(4, 3), [3, 2, 1])
    assert get_cached_block(state, H2, [0]) == (3,)


def test_a_block_handed_out_again_is_no_longer_a_hit() -> None:
    state, _ = free_blocks(cached(3, 2), [1, 2])
    state, _ = get_new_blocks(state, 1)
    assert get_cached_block(state, H0, [0]) is None
    assert get_cached_block(state, H1, [0]) == (2,)


def test_an_evicted_block_is_no_longer_a_hit() -> None:
    state, _ = evict_blocks(cached(3, 2), {1})
    assert get_cached_block(state, H0, [0]) is None
    assert get_cached_block(state, H1, [0]) == (2,)
