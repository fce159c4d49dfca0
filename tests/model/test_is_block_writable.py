"""is_block_writable: held once, no key, not the null block (vLLM 0.33)."""

from kvpool.model import UnknownBlock, get_new_blocks, is_block_writable, new_pool, touch
from tests.model.helpers import cached


def test_invalid_unknown_block() -> None:
    try:
        is_block_writable(new_pool(3), 3)
    except UnknownBlock:
        return
    raise AssertionError("no UnknownBlock")


def test_a_fresh_block_held_once_is_writable() -> None:
    state, _ = get_new_blocks(new_pool(3), 1)
    assert is_block_writable(state, 1)


def test_free_shared_keyed_and_null_blocks_are_not() -> None:
    state = cached(5, 1)
    state, _ = get_new_blocks(state, 1)
    state, _ = touch(state, [2])
    assert not is_block_writable(state, 1)  # keyed
    assert not is_block_writable(state, 2)  # held twice
    assert not is_block_writable(state, 3)  # free
    assert not is_block_writable(state, 0)  # the null block
