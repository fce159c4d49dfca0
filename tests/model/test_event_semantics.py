"""The event-semantics axis of a profile: when a removal of a duplicated hash is published.

``multiset`` (every vLLM release): one ``BlockRemoved`` per block that loses
a key. ``last-copy`` (vllm-project/vllm#55092): only when the last block under
the key loses it. Stores are published per block under both.
"""

from dataclasses import replace

import pytest

from kvpool.model import (
    APPEND,
    EVENT_SEMANTICS,
    HASHLESS_FIRST,
    MEDIUM_GPU,
    PROFILES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheRequest,
    EventSemantics,
    InvalidConfig,
    PoolState,
    Profile,
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_new_blocks,
    new_pool,
    take_events,
)
from kvpool.model.events import fold_events
from kvpool.model.profiles import profile_named, with_event_semantics
from kvpool.specs.pool.invariants import event_stream_consistency

LAST_COPY = with_event_semantics(HASHLESS_FIRST, EventSemantics.LAST_COPY)
A = CacheRequest(block_hashes=(b"a",), all_token_ids=(1,))


def two_copies(profile: Profile = HASHLESS_FIRST) -> PoolState:
    """Blocks 1 and 2 both cached under (b"a", 0), 1 first; events taken."""
    state, ids = get_new_blocks(new_pool(4, enable_events=True, profile=profile), 2)
    for block_id in ids:
        state, _ = cache_full_blocks(state, A, [block_id], 0, 1, 1, 0)
    state, _ = take_events(state)
    return state


def removals(state: PoolState) -> list[BlockRemoved]:
    return [e for e in take_events(state)[1] if isinstance(e, BlockRemoved)]


# --------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------


def test_every_existing_profile_keeps_its_name_and_the_multiset_semantics() -> None:
    for name, profile in PROFILES.items():
        assert profile.event_semantics is EventSemantics.MULTISET
        assert profile_named(name) is profile
        assert with_event_semantics(profile, EventSemantics.MULTISET) is profile


def test_a_last_copy_profile_is_named_after_both_axes_and_keeps_the_free_order() -> None:
    profile = profile_named("append+last-copy")
    assert profile.name == "append+last-copy"
    assert profile.free_order is APPEND.free_order
    assert profile.event_semantics is EventSemantics.LAST_COPY
    assert with_event_semantics(profile, EventSemantics.MULTISET) is APPEND
    assert set(EVENT_SEMANTICS) == {"multiset", "last-copy"}


@pytest.mark.parametrize(
    "name", ["", "append+", "append+set", "unknown", "unknown+last-copy", "+last-copy", None, 3]
)
def test_invalid_unknown_profile_name(name: object) -> None:
    with pytest.raises(InvalidConfig):
        profile_named(name)  # type: ignore[arg-type]  # None and 3 on purpose


# --------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------


def test_multiset_publishes_a_removal_per_copy() -> None:
    state, _ = evict_blocks(two_copies(), {1})
    state, _ = evict_blocks(state, {2})
    assert [e.block_hashes for e in removals(state)] == [(b"a",), (b"a",)]


def test_last_copy_publishes_only_the_last_removal() -> None:
    state, _ = evict_blocks(two_copies(LAST_COPY), {1})
    assert removals(state) == []
    state, _ = evict_blocks(two_copies(LAST_COPY), {1, 2})
    assert removals(state) == [BlockRemoved((b"a",), MEDIUM_GPU, 0)]


def test_last_copy_publishes_every_store() -> None:
    state, ids = get_new_blocks(new_pool(4, enable_events=True, profile=LAST_COPY), 2)
    for block_id in ids:
        state, _ = cache_full_blocks(state, A, [block_id], 0, 1, 1, 0)
    stored = [e for e in take_events(state)[1] if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [(b"a",), (b"a",)]


def test_last_copy_counts_copies_per_group() -> None:
    state, ids = get_new_blocks(new_pool(4, enable_events=True, profile=LAST_COPY), 2)
    state, _ = cache_full_blocks(state, A, [ids[0]], 0, 1, 1, 0)
    state, _ = cache_full_blocks(state, A, [ids[1]], 0, 1, 1, 1)
    state, _ = take_events(state)
    state, _ = evict_blocks(state, {ids[0]})
    assert removals(state) == [BlockRemoved((b"a",), MEDIUM_GPU, 0)]


def test_last_copy_eviction_by_allocation_publishes_only_the_last_copy() -> None:
    state = two_copies(LAST_COPY)
    state, _ = free_blocks(state, [1, 2])
    state, _ = get_new_blocks(state, 2)  # 3 first, then 1: block 2 keeps the key
    assert removals(state) == []
    state, _ = get_new_blocks(state, 1)
    assert removals(state) == [BlockRemoved((b"a",), MEDIUM_GPU, 0)]


def test_last_copy_promotion_of_a_shared_partial_key_is_silent() -> None:
    profile = LAST_COPY
    request = CacheRequest(block_hashes=(b"p", b"pq"), all_token_ids=(1, 2))
    state, ids = get_new_blocks(new_pool(4, enable_events=True, profile=profile), 2)
    for block_id in ids:
        state, _ = cache_partial_block(state, request, block_id, 1, 0, 2)
    state, _ = take_events(state)
    state, _ = cache_full_blocks(state, request, [ids[0]], 0, 1, 2, 0)
    assert removals(state) == []


def test_the_default_profile_emits_exactly_what_it_did_before_the_axis() -> None:
    state, _ = evict_blocks(two_copies(), {1, 2})
    assert removals(state) == [BlockRemoved((b"a",), MEDIUM_GPU, 0)] * 2


# --------------------------------------------------------------------------
# The fold
# --------------------------------------------------------------------------

STORED = BlockStored((b"a",), None, (1,), 1, None, MEDIUM_GPU, None, (None,), 0)
REMOVED = BlockRemoved((b"a",), MEDIUM_GPU, 0)


def test_the_multiset_fold_counts_copies() -> None:
    assert +fold_events([STORED, STORED, REMOVED]) == {(b"a", 0): 1}


def test_the_last_copy_fold_keeps_a_set() -> None:
    semantics = EventSemantics.LAST_COPY
    assert +fold_events([STORED, STORED], semantics) == {(b"a", 0): 1}
    assert +fold_events([STORED, STORED, REMOVED], semantics) == {}


@pytest.mark.parametrize("semantics", list(EventSemantics))
def test_a_removal_of_what_was_never_stored_goes_negative(semantics: EventSemantics) -> None:
    assert fold_events([REMOVED], semantics)[(b"a", 0)] < 0


@pytest.mark.parametrize("semantics", list(EventSemantics))
def test_cleared_empties_the_fold(semantics: EventSemantics) -> None:
    assert +fold_events([STORED, STORED, AllBlocksCleared()], semantics) == {}


def test_the_fold_continues_from_a_start_without_changing_it() -> None:
    start = fold_events([STORED])
    assert +fold_events([STORED], start=start) == {(b"a", 0): 2}
    assert start == {(b"a", 0): 1}


@pytest.mark.parametrize("profile", [HASHLESS_FIRST, LAST_COPY])
def test_event_stream_consistency_holds_under_each_semantics(profile: Profile) -> None:
    state = two_copies(profile)
    taken = [STORED, STORED]
    assert event_stream_consistency(state, taken) is None
    state, _ = evict_blocks(state, {1})
    assert event_stream_consistency(state, taken) is None


def test_event_stream_consistency_reads_the_stream_by_the_profile() -> None:
    """A multiset stream read as last-copy (or the reverse) describes another cache."""
    multiset, _ = evict_blocks(two_copies(), {1})
    relabelled = replace(multiset, config=replace(multiset.config, profile=LAST_COPY))
    assert event_stream_consistency(relabelled, [STORED, STORED]) is not None
