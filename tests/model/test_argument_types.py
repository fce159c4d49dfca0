"""Arguments of the wrong type: a named error and the state unchanged (issue 20)."""

from collections.abc import Callable

import pytest

from kvpool.model import (
    CacheRequest,
    InvalidArgument,
    InvalidConfig,
    UnknownBlock,
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    new_pool,
    touch,
)
from tests.model.helpers import REQ, assert_rejected, cached, held


def test_invalid_count_that_is_no_int() -> None:
    assert_rejected(lambda: new_pool(4), InvalidArgument, get_new_blocks, 1.0)
    assert_rejected(lambda: new_pool(4), InvalidArgument, get_new_blocks, True)


@pytest.mark.parametrize("op", [touch, free_blocks, evict_blocks])
def test_invalid_block_id_that_is_no_int(op: Callable[..., object]) -> None:
    assert_rejected(lambda: held(4, 2), UnknownBlock, op, [1, "2"])
    assert_rejected(lambda: held(4, 2), UnknownBlock, op, [1, None])


@pytest.mark.parametrize("op", [touch, free_blocks, evict_blocks])
def test_invalid_id_list_that_is_no_collection(op: Callable[..., object]) -> None:
    assert_rejected(lambda: held(4, 2), InvalidArgument, op, 1)
    assert_rejected(lambda: held(4, 2), InvalidArgument, op, "12")


def test_invalid_cache_full_blocks_arguments_of_other_types() -> None:
    assert_rejected(
        lambda: held(5, 2), InvalidArgument, cache_full_blocks, REQ, [1, 2], 0, "2", 1, 0
    )
    assert_rejected(
        lambda: held(5, 2), InvalidArgument, cache_full_blocks, None, [1, 2], 0, 2, 1, 0
    )
    bad_hash = CacheRequest(("h0", "h1"), (1, 2))  # type: ignore[arg-type]
    assert_rejected(
        lambda: held(5, 2), InvalidArgument, cache_full_blocks, bad_hash, [1], 0, 1, 1, 0
    )


def test_invalid_cache_partial_block_arguments_of_other_types() -> None:
    two = CacheRequest((b"a", b"b"), (1, 2, 3, 4))
    build = lambda: held(4, 1, hash_block_size=2)  # noqa: E731
    assert_rejected(build, InvalidArgument, cache_partial_block, two, 1, 2.0, 0, 4)
    assert_rejected(build, UnknownBlock, cache_partial_block, two, 1.0, 2, 0, 4)


def test_invalid_lookup_arguments_of_other_types() -> None:
    with pytest.raises(InvalidArgument):
        get_cached_block(cached(4, 1), "h0", [0])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        get_cached_block(cached(4, 1), b"h0", [None])  # type: ignore[list-item]


def test_invalid_pool_parameters_of_other_types() -> None:
    with pytest.raises(InvalidArgument):
        new_pool("4")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        new_pool(4, medium=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig):
        new_pool(4, num_hash_lookahead_tokens=-1)
