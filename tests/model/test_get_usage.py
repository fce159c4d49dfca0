"""get_usage: the fraction of usable blocks that are held."""

from kvpool.model import free_blocks, get_usage, new_pool, touch
from tests.model.helpers import cached, held


def test_fresh_pool_is_unused() -> None:
    assert get_usage(new_pool(5)) == 0.0


def test_single_block_pool_reports_zero_not_a_division_error() -> None:
    assert get_usage(new_pool(1)) == 0.0


def test_every_block_held_is_full_usage() -> None:
    assert get_usage(held(5, 4)) == 1.0


def test_half_the_usable_blocks_held_is_half_usage() -> None:
    assert get_usage(held(5, 2)) == 0.5


def test_the_null_block_is_not_counted() -> None:
    assert get_usage(held(2, 1)) == 1.0


def test_extra_references_do_not_count_twice() -> None:
    state, _ = touch(held(5, 1), [1, 1])
    assert get_usage(state) == 0.25


def test_cached_free_blocks_count_as_unused() -> None:
    state, _ = free_blocks(cached(5, 2), [2, 1])
    assert get_usage(state) == 0.0
