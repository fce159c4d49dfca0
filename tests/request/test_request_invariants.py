"""Each safety property fails on a state that breaks it: none of them is vacuous."""

from dataclasses import replace

from kvpool.model.manager import KVCacheManagerState, allocate_slots, new_kv_cache_manager
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention
from kvpool.specs.request.invariants import (
    KVTruth,
    cached_blocks_hold_their_prefix,
    hit_matches_request,
    ref_counts_match_tables,
    request_content,
    requests_read_their_own_kv,
    write_is_exclusive,
)

A = new_request("a", (1, 2, 1, 2), 2)
B = new_request("b", (1, 2, 2, 2), 2, cache_salt="s")


def computed_a() -> tuple[KVTruth, KVCacheManagerState]:
    """Request a computed its 4 tokens into blocks 1, 2, which are cached; the truth agrees."""
    state = new_kv_cache_manager(6, [full_attention(2)], 16)
    state, _ = allocate_slots(state, A, 4)
    truth = KVTruth()
    truth.learn_hashes(A)
    content = request_content(A)
    for position in range(4):
        truth.write(0, 1 + position // 2, position % 2, content.prefix(position + 1))
    return truth, state


def test_a_consistent_state_passes() -> None:
    truth, state = computed_a()
    pool = state.managers.pool
    tables = {"a": ((1, 2),)}
    assert cached_blocks_hold_their_prefix(truth, pool, [2]) is None
    assert requests_read_their_own_kv(truth, {"a": with_computed(A, 4)}, tables, [2]) is None
    assert hit_matches_request(truth, new_request("c", (1, 2, 1, 2, 1), 2), ((1, 2),), [2]) is None
    assert ref_counts_match_tables(pool, tables) is None
    assert write_is_exclusive(3, "a", tables) is None


def test_a_cached_block_overwritten_is_caught() -> None:
    truth, state = computed_a()
    truth.write(0, 2, 1, request_content(B).prefix(4))
    reason = cached_blocks_hold_their_prefix(truth, state.managers.pool, [2])
    assert reason is not None and "block 2" in reason


def test_kv_of_another_group_is_caught() -> None:
    truth, state = computed_a()
    truth.write(1, 1, 0, request_content(A).prefix(1))
    assert cached_blocks_hold_their_prefix(truth, state.managers.pool, [2]) is not None


def test_a_hash_naming_two_prefixes_is_caught() -> None:
    truth, state = computed_a()
    truth.learn_hashes(replace(B, block_hashes=A.block_hashes))
    reason = cached_blocks_hold_their_prefix(truth, state.managers.pool, [2])
    assert reason is not None and "names" in reason


def test_an_unknown_hash_in_the_map_is_caught() -> None:
    _, state = computed_a()
    assert cached_blocks_hold_their_prefix(KVTruth(), state.managers.pool, [2]) is not None


def test_a_request_reading_foreign_kv_is_caught() -> None:
    truth, _ = computed_a()
    truth.write(0, 1, 0, request_content(B).prefix(1))
    running = {"a": with_computed(A, 4)}
    assert requests_read_their_own_kv(truth, running, {"a": ((1, 2),)}, [2]) is not None
    # positions not computed yet are not read
    assert requests_read_their_own_kv(truth, {"a": A}, {"a": ((1, 2),)}, [2]) is None


def test_a_hit_of_another_tenant_is_caught() -> None:
    truth, _ = computed_a()
    salted = new_request("c", (1, 2, 1, 2, 1), 2, cache_salt="s")
    assert hit_matches_request(truth, salted, ((1,),), [2]) is not None


def test_shared_and_null_writes_are_caught() -> None:
    tables = {"a": ((1, 2),), "b": ((1, 3),)}
    assert write_is_exclusive(1, "b", tables) is not None
    assert write_is_exclusive(0, "b", tables) is not None


def test_leaked_and_missing_references_are_caught() -> None:
    _, state = computed_a()
    pool = state.managers.pool
    assert ref_counts_match_tables(pool, {"a": ((1,),)}) is not None
    assert ref_counts_match_tables(pool, {"a": ((1, 2, 2),)}) is not None
