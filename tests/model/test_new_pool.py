"""new_pool: construction of a fresh pool."""

import pytest

from kvpool.model import (
    APPEND,
    DEFAULT_PROFILE,
    HASHLESS_FIRST,
    BlockState,
    InvalidConfig,
    PoolConfig,
    new_pool,
)
from kvpool.specs.pool.invariants import FreeHistory, check_all

# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


def test_invalid_num_blocks_zero_leaves_no_room_for_the_null_block() -> None:
    with pytest.raises(InvalidConfig) as info:
        new_pool(0)
    assert type(info.value) is InvalidConfig


def test_invalid_num_blocks_negative() -> None:
    with pytest.raises(InvalidConfig) as info:
        new_pool(-3)
    assert type(info.value) is InvalidConfig


def test_invalid_hash_block_size_zero() -> None:
    with pytest.raises(InvalidConfig) as info:
        new_pool(4, hash_block_size=0)
    assert type(info.value) is InvalidConfig


def test_invalid_hash_block_size_negative() -> None:
    with pytest.raises(InvalidConfig) as info:
        new_pool(4, hash_block_size=-1)
    assert type(info.value) is InvalidConfig


# --------------------------------------------------------------------------
# Behaviour
# --------------------------------------------------------------------------


def test_every_block_but_the_null_block_is_free_in_id_order() -> None:
    state = new_pool(5)
    assert state.free_queue == (1, 2, 3, 4)


def test_every_block_starts_unheld_and_hashless() -> None:
    state = new_pool(5)
    assert state.blocks == tuple(BlockState() for _ in range(5))
    assert dict(state.cached) == {}
    assert state.pending_events == ()


def test_single_block_pool_has_only_the_null_block_and_nothing_free() -> None:
    state = new_pool(1)
    assert state.free_queue == ()
    assert len(state.blocks) == 1
    check_all(state, FreeHistory.start(state), ())


def test_config_records_the_parameters() -> None:
    state = new_pool(3, enable_caching=False, hash_block_size=4, enable_events=True, profile=APPEND)
    assert state.config == PoolConfig(
        num_blocks=3, enable_caching=False, hash_block_size=4, enable_events=True, profile=APPEND
    )


def test_defaults_are_caching_on_events_off_hash_block_size_one_default_profile() -> None:
    state = new_pool(2)
    assert state.config == PoolConfig(2, True, 1, False, DEFAULT_PROFILE)
    assert DEFAULT_PROFILE is HASHLESS_FIRST


def test_two_pools_built_alike_are_equal() -> None:
    assert new_pool(6, hash_block_size=2) == new_pool(6, hash_block_size=2)
    assert new_pool(6) != new_pool(7)


@pytest.mark.parametrize("num_blocks", [1, 2, 8])
def test_fresh_pool_satisfies_every_invariant(num_blocks: int) -> None:
    state = new_pool(num_blocks, enable_events=True)
    check_all(state, FreeHistory.start(state), ())
