"""The radix model, rule by rule: insert, split, de-duplication, match, locks, eviction, events."""

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.model import AllBlocksCleared, BlockRemoved, BlockStored, InvalidConfig, v0
from kvpool.model import radix as r
from kvpool.model.radix import RadixState
from kvpool.model.radix_errors import (
    InvalidPrefixLength,
    InvalidPriority,
    InvalidSlots,
    InvalidTokenCount,
    InvalidTokens,
    NotLocked,
    TooFewSlots,
    UnknownNode,
)
from kvpool.specs.radix.invariants import check_all


def cache_of(*keys: list[int], page_size: int = 1, policy: str = "lru") -> RadixState:
    """A cache with each key inserted in turn, slots numbered 100, 101, ... per key position."""
    state = r.new_radix_cache(page_size, policy)
    for n, key in enumerate(keys):
        state, _ = r.insert(state, key, [100 * (n + 1) + i for i in range(len(key))])
    return state


def assert_rejected(
    build: Callable[[], RadixState], error: type[Exception], op: Callable[..., Any], *args: Any
) -> None:
    """``op(build(), *args)`` raises exactly ``error`` and leaves the state as a rebuilt copy."""
    state = build()
    with pytest.raises(error) as info:
        op(state, *args)
    assert type(info.value) is error
    assert state == build()


def events(state: RadixState) -> tuple[Any, ...]:
    return r.take_events(state)[1]


# --------------------------------------------------------------------------
# Preconditions, one test per rejection
# --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, -1, 1.0, "2", None])
def test_invalid_config_page_size(page_size: Any) -> None:
    with pytest.raises(InvalidConfig):
        r.new_radix_cache(page_size)


def test_invalid_config_unknown_policy() -> None:
    with pytest.raises(InvalidConfig):
        r.new_radix_cache(policy="tlru")


def test_invalid_config_slru_threshold_not_an_integer() -> None:
    with pytest.raises(InvalidConfig):
        r.new_radix_cache(policy="slru", slru_protected_threshold=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [[1, -1], [2**32], [1.0], ["a"], "ab", None, 3, [True]])
def test_invalid_tokens_insert(tokens: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), InvalidTokens, r.insert, tokens, [1, 2])


@pytest.mark.parametrize("tokens", [[1, -1], [2**32], ["a"], b"ab", None])
def test_invalid_tokens_match_prefix(tokens: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), InvalidTokens, r.match_prefix, tokens)


@pytest.mark.parametrize("slots", [[1, -2], [1.0, 2], None, "ab", [None, 1]])
def test_invalid_slots(slots: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), InvalidSlots, r.insert, [3, 4], slots)


def test_invalid_too_few_slots() -> None:
    assert_rejected(lambda: cache_of([1, 2]), TooFewSlots, r.insert, [3, 4], [7])


def test_invalid_too_few_slots_counts_the_page_aligned_key_only() -> None:
    state = r.new_radix_cache(2)
    state, result = r.insert(state, [1, 2, 3], [7, 8])  # the third token is no whole page
    assert result.path == (1, 2)
    assert_rejected(lambda: r.new_radix_cache(2), TooFewSlots, r.insert, [1, 2, 3, 4], [7, 8, 9])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prev_prefix_len": -1},
        {"inserted_len": -2},
        {"prev_prefix_len": 1.5},
        {"inserted_len": "1"},
    ],
)
def test_invalid_prefix_length(kwargs: dict[str, Any]) -> None:
    def op(state: RadixState) -> Any:
        return r.insert(state, [1, 2], [5, 6], **kwargs)

    assert_rejected(lambda: cache_of([1, 2]), InvalidPrefixLength, op)


@pytest.mark.parametrize("priority", [1.5, "high", None])
def test_invalid_priority(priority: Any) -> None:
    def op(state: RadixState) -> Any:
        return r.insert(state, [3], [5], priority=priority)

    assert_rejected(lambda: cache_of([1, 2]), InvalidPriority, op)


@pytest.mark.parametrize("path", [(1,), (9,), (1, 2, 3), [1, 2], "12", None])
def test_invalid_lock_unknown_node(path: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), UnknownNode, r.lock, path)


def test_invalid_lock_evicted_node() -> None:
    def build() -> RadixState:
        return r.evict(cache_of([1, 2]), 2)[0]

    assert_rejected(build, UnknownNode, r.lock, (1, 2))


@pytest.mark.parametrize("path", [(1,), (7, 7)])
def test_invalid_unlock_unknown_node(path: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), UnknownNode, r.unlock, path)


def test_invalid_unlock_not_locked() -> None:
    assert_rejected(lambda: cache_of([1, 2]), NotLocked, r.unlock, (1, 2))


def test_invalid_unlock_once_more_than_locked() -> None:
    def build() -> RadixState:
        state, _ = r.lock(cache_of([1, 2]), (1, 2))
        return r.unlock(state, (1, 2))[0]

    assert_rejected(build, NotLocked, r.unlock, (1, 2))


@pytest.mark.parametrize("num_tokens", [-1, 1.5, "3", None])
def test_invalid_token_count(num_tokens: Any) -> None:
    assert_rejected(lambda: cache_of([1, 2]), InvalidTokenCount, r.evict, num_tokens)


def test_invalid_path_slots_unknown_node() -> None:
    with pytest.raises(UnknownNode):
        r.path_slots(cache_of([1, 2]), (1,))


# --------------------------------------------------------------------------
# Construction and events of construction
# --------------------------------------------------------------------------


def test_a_new_cache_is_empty_and_announces_a_clear() -> None:
    state = r.new_radix_cache(4)
    assert state.nodes == {} and state.pending_events == (AllBlocksCleared(),)
    assert r.new_radix_cache(enable_events=False).pending_events == ()
    check_all(state)


# --------------------------------------------------------------------------
# Insert: pages, splits, de-duplication, priorities, hits
# --------------------------------------------------------------------------


def test_insert_cuts_the_key_to_whole_pages_and_ignores_extra_slots() -> None:
    state, result = r.insert(r.new_radix_cache(2), [1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    assert result.path == (1, 2, 3, 4) and result.prefix_len == 0
    assert r.tree_view(state) == (((1, 2, 3, 4), (10, 11, 12, 13)),)


def test_an_empty_or_sub_page_insert_changes_nothing() -> None:
    state = cache_of([1, 2], page_size=2)
    for tokens in ([], [7]):
        after, result = r.insert(state, tokens, [9][: len(tokens)])
        assert after == state and result == r.InsertResult(0, (), ())


def test_a_diverging_insert_splits_at_the_page_boundary() -> None:
    state, result = r.insert(cache_of([1, 2, 3, 4], page_size=2), [1, 2, 9, 9], [5, 6, 7, 8])
    assert result.prefix_len == 2 and result.duplicates == ((5, 6),)
    assert r.tree_view(state) == (
        ((1, 2), (100, 101)),
        ((1, 2, 3, 4), (102, 103)),
        ((1, 2, 9, 9), (7, 8)),
    )
    check_all(state)


def test_a_divergence_inside_a_page_splits_at_the_page_before_it() -> None:
    state, result = r.insert(cache_of([1, 2, 3, 4], page_size=2), [1, 9, 3, 4], [5, 6, 7, 8])
    assert result.prefix_len == 0 and result.duplicates == ()
    assert sorted(state.nodes) == [(1, 2, 3, 4), (1, 9, 3, 4)]


def test_duplicates_are_returned_per_node_from_prev_prefix_len_on() -> None:
    state = cache_of([1, 2], [1, 2, 3, 4])  # two nodes: (1, 2) and (1, 2, 3, 4)
    _, all_dups = r.insert(state, [1, 2, 3, 4, 5], [50, 51, 52, 53, 54])
    assert all_dups.prefix_len == 4 and all_dups.duplicates == ((50, 51), (52, 53))
    _, shared = r.insert(state, [1, 2, 3, 4, 5], [100, 101, 52, 53, 54], prev_prefix_len=3)
    assert shared.duplicates == ((53,),)
    _, beyond = r.insert(state, [1, 2, 3, 4, 5], [100, 101, 202, 203, 54], prev_prefix_len=5)
    assert beyond.duplicates == ()


def test_a_full_duplicate_insert_returns_its_node_and_stores_nothing() -> None:
    state, _ = r.take_events(cache_of([1, 2, 3]))
    state, result = r.insert(state, [1, 2, 3], [7, 8, 9])
    assert result == r.InsertResult(3, (1, 2, 3), ((7, 8, 9),))
    assert events(state) == ()


def test_the_insert_de_duplicates_like_the_v0_allocator() -> None:
    """Where the radix cache and v0 agree: the second copy of cached content is not kept.

    v0 moves a full block onto the block already caching its content and
    releases its own; the radix cache keeps its own slots and hands the
    caller's back as duplicates. Either way one copy of the KV stays.
    """
    tokens = [5, 6, 7, 8]
    state = r.new_radix_cache(2)
    state, _ = r.insert(state, tokens, [0, 1, 2, 3])
    state, second = r.insert(state, tokens, [4, 5, 6, 7])
    assert second.duplicates == ((4, 5, 6, 7),) and r.total_size(state) == 4

    alloc = v0.new_allocator(4, 2)
    alloc, first = v0.allocate_immutable_blocks(alloc, None, [[5, 6], [7, 8]])
    alloc, a = v0.allocate_mutable_block(alloc)
    alloc, b = v0.allocate_mutable_block(alloc, a)
    alloc, _ = v0.append_token_ids(alloc, a, [5, 6])
    alloc, _ = v0.append_token_ids(alloc, b, [7, 8])
    assert [alloc.handles[h].block_id for h in (a, b)] == [alloc.handles[h].block_id for h in first]
    assert len(alloc.cached) == 2 and len(alloc.hashless_free) == 2  # both copies released


def test_priorities_rise_along_the_walk_and_a_split_keeps_the_lower_part_s() -> None:
    state = r.new_radix_cache()
    state, _ = r.insert(state, [1, 2, 3], [10, 11, 12], priority=1)
    state, _ = r.insert(state, [1, 4], [20, 21], priority=5)
    assert state.nodes[(1,)].priority == 5  # the walked (split-off) upper node
    assert state.nodes[(1, 2, 3)].priority == 1  # the lower part keeps its own
    assert state.nodes[(1, 4)].priority == 5


def test_hits_count_the_nodes_walked_past_inserted_len() -> None:
    state = r.new_radix_cache()
    state, _ = r.insert(state, [1, 2], [10, 11])
    state, _ = r.insert(state, [1, 2, 3], [10, 11, 12], prev_prefix_len=2, inserted_len=2)
    assert state.nodes[(1, 2)].hit_count == 1  # not counted again: the request's own
    assert state.nodes[(1, 2, 3)].hit_count == 1
    state, _ = r.insert(state, [1, 2, 3], [10, 11, 12], prev_prefix_len=3)
    assert state.nodes[(1, 2)].hit_count == 2 and state.nodes[(1, 2, 3)].hit_count == 2


# --------------------------------------------------------------------------
# match_prefix
# --------------------------------------------------------------------------


def test_match_returns_the_longest_page_aligned_prefix_and_splits_there() -> None:
    state, hit = r.match_prefix(cache_of([1, 2, 3, 4, 5, 6], page_size=2), [1, 2, 3, 9])
    assert hit == r.MatchResult(2, (1, 2), (100, 101))
    assert sorted(state.nodes) == [(1, 2), (1, 2, 3, 4, 5, 6)]
    check_all(state)


def test_a_match_past_a_leaf_stops_at_its_end() -> None:
    _, hit = r.match_prefix(cache_of([1, 2]), [1, 2, 3])
    assert hit == r.MatchResult(2, (1, 2), (100, 101))


def test_a_sub_page_or_missing_match_changes_nothing() -> None:
    state = cache_of([1, 2], page_size=2)
    assert r.match_prefix(state, [1]) == (state, r.MatchResult(0, (), ()))
    after, hit = r.match_prefix(state, [5, 6])
    assert hit == r.MatchResult(0, (), ()) and after.nodes == state.nodes


def test_a_split_emits_no_event() -> None:
    """sgl-project/sglang#14934: the pages a split moves stay cached, so nothing is said."""
    state, _ = r.take_events(cache_of([1, 2, 3, 4]))
    state, _ = r.match_prefix(state, [1, 2])
    state, _ = r.insert(state, [1, 2, 9], [5, 6, 7])
    assert [type(e) for e in events(state)] == [BlockStored]


# --------------------------------------------------------------------------
# Recency: the logical clock
# --------------------------------------------------------------------------


def test_match_refreshes_the_path_and_the_split_off_suffix() -> None:
    state = cache_of([1, 2, 3, 4], [5, 6])
    state, _ = r.match_prefix(state, [1, 2])
    assert r.eviction_order(state)[0] == (5, 6)  # the suffix (3, 4) was stamped too


def test_a_node_split_by_an_insert_is_older_than_the_new_sibling_leaf() -> None:
    state, _ = r.insert(cache_of([1, 2, 3]), [1, 2, 9], [5, 6, 7])
    assert state.nodes[(1, 2, 3)].last_access < state.nodes[(1, 2, 9)].last_access
    assert r.eviction_order(state)[0] == (1, 2, 3)


def test_locks_and_evictions_stamp_nothing() -> None:
    state = cache_of([1, 2], [3])
    stamps = {p: n.last_access for p, n in state.nodes.items()}
    state, _ = r.lock(state, (1, 2))
    state, _ = r.unlock(state, (1, 2))
    state, _ = r.evict(state, 0)
    assert {p: n.last_access for p, n in state.nodes.items()} == stamps


# --------------------------------------------------------------------------
# Locks
# --------------------------------------------------------------------------


def test_a_lock_holds_the_node_and_every_ancestor() -> None:
    state = cache_of([1, 2], [1, 2, 3, 4])
    state, protected = r.lock(state, (1, 2, 3, 4))
    assert protected == 4 and r.protected_size(state) == 4 and r.evictable_size(state) == 0
    state, again = r.lock(state, (1, 2))
    assert again == 0 and state.nodes[(1, 2)].lock_ref == 2
    state, released = r.unlock(state, (1, 2, 3, 4))
    assert released == 2 and r.protected_size(state) == 2
    check_all(state)


def test_locking_the_root_protects_nothing() -> None:
    state = cache_of([1, 2])
    assert r.lock(state, ()) == (state, 0)
    assert r.unlock(state, ()) == (state, 0)


def test_a_split_lock_is_inherited_by_the_upper_part() -> None:
    state, _ = r.lock(cache_of([1, 2, 3, 4]), (1, 2, 3, 4))
    state, _ = r.match_prefix(state, [1, 2])
    assert state.nodes[(1, 2)].lock_ref == 1 and state.nodes[(1, 2, 3, 4)].lock_ref == 1
    state, _ = r.unlock(state, (1, 2, 3, 4))
    assert r.protected_size(state) == 0 and r.evictable_size(state) == 4


# --------------------------------------------------------------------------
# Eviction
# --------------------------------------------------------------------------


def test_evict_removes_whole_leaves_least_recent_first_and_may_overshoot() -> None:
    state, _ = r.take_events(cache_of([1, 2], [3, 4, 5], [6]))
    state, result = r.evict(state, 1)
    assert result == r.EvictResult(2, ((100, 101),))
    assert events(state) == (BlockRemoved(r.page_hashes((1, 2), 1), "GPU", 0),)


def test_evict_skips_locked_paths_and_takes_parents_in_the_same_call() -> None:
    state = cache_of([1, 2], [1, 2, 3], [9])
    state, _ = r.lock(state, (9,))
    state, result = r.evict(state, 10)
    assert result.freed == ((202,), (100, 101)) and result.num_evicted == 3
    assert sorted(state.nodes) == [(9,)]


def test_evict_zero_evicts_nothing() -> None:
    state = cache_of([1])
    assert r.evict(state, 0) == (state, r.EvictResult(0, ()))


def test_removals_of_one_call_merge_into_one_event() -> None:
    state, _ = r.take_events(cache_of([1], [2]))
    state, _ = r.evict(state, 2)
    (removed,) = events(state)
    assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2


@pytest.mark.parametrize(
    ("policy", "first"),
    [
        ("lru", (3,)),
        ("mru", (1,)),
        ("fifo", (1,)),
        ("filo", (3,)),
        ("lfu", (1,)),
        ("slru", (1,)),
        ("priority", (2,)),
    ],
)
def test_each_policy_picks_its_victim(policy: str, first: tuple[int, ...]) -> None:
    state = r.new_radix_cache(policy=policy)
    for token, priority in ((1, 2), (2, 0), (3, 1), (3, 0), (3, 0), (2, 0)):
        state, _ = r.insert(state, [token], [10 * token], priority=priority)
    state, _ = r.match_prefix(state, [1])
    # access: 3 oldest, 1 newest; creation: 1 first, 3 last; hits: 1 once, 2 twice,
    # 3 three times; priority: 2 lowest (0)
    assert r.eviction_order(state)[0] == first


def test_fifo_keeps_the_creation_of_a_split_node_in_its_upper_part() -> None:
    """The unified cores copy the creation time into the split-off part (RadixCache does not)."""
    state = r.new_radix_cache(policy="fifo")
    state, _ = r.insert(state, [1, 2, 3, 4], [10, 11, 12, 13])
    state, _ = r.insert(state, [5], [20])
    state, _ = r.match_prefix(state, [1, 2])
    assert r.evict(state, 3)[1].freed == ((12, 13), (10, 11))


# --------------------------------------------------------------------------
# Reset and events
# --------------------------------------------------------------------------


def test_reset_drops_everything_frees_nothing_and_keeps_pending_events() -> None:
    state = cache_of([1, 2])
    state, _ = r.lock(state, (1, 2))
    state, _ = r.reset(state)
    assert state.nodes == {} and r.protected_size(state) == 0
    assert [type(e) for e in events(state)] == [AllBlocksCleared, BlockStored, AllBlocksCleared]


def test_chained_stores_merge_and_a_new_branch_starts_a_new_event() -> None:
    state, _ = r.take_events(r.new_radix_cache(2))
    state, _ = r.insert(state, [1, 2, 3, 4], [0, 1, 2, 3])
    state, _ = r.insert(state, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    state, _ = r.insert(state, [1, 2, 7, 7], [0, 1, 6, 7])
    first, second = events(state)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.token_ids == (1, 2, 3, 4, 5, 6) and len(first.block_hashes) == 3
    assert second.parent_block_hash == first.block_hashes[0] and second.token_ids == (7, 7)


def test_page_hashes_are_sglang_0_5_23_s() -> None:
    """Known answers, read from SGLang 0.5.23's events (page size 2)."""
    hashes = [r.event_hash_int(h) for h in r.page_hashes((1, 2, 3, 4, 5, 6), 2)]
    assert hashes == [3817746824117602890, -4216701448867210342, 5371148316746243504]


def test_no_events_are_queued_with_events_off() -> None:
    state = r.new_radix_cache(enable_events=False)
    state, _ = r.insert(state, [1, 2], [1, 2])
    state, _ = r.evict(state, 5)
    state, _ = r.reset(state)
    assert events(state) == ()


# --------------------------------------------------------------------------
# Properties over random programs
# --------------------------------------------------------------------------

KEYS = st.lists(st.integers(1, 3), max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.tuples(st.sampled_from("ime"), KEYS), max_size=12),
    page_size=st.integers(1, 2),
)
def test_no_two_eviction_candidates_ever_share_a_stamp(
    keys: list[tuple[str, list[int]]], page_size: int
) -> None:
    """The written tie-break (path order) is never needed: candidates never share a stamp."""
    state = r.new_radix_cache(page_size)
    for n, (op, key) in enumerate(keys):
        if op == "i":
            state, _ = r.insert(state, key, list(range(100 * n, 100 * n + len(key))))
        elif op == "m":
            state, _ = r.match_prefix(state, key)
        else:
            state, _ = r.evict(state, len(key))
        check_all(state, ())
        leaves = [p for p in state.nodes if not any(n.parent == p for n in state.nodes.values())]
        stamps = [state.nodes[p].last_access for p in leaves]
        assert len(set(stamps)) == len(stamps)
