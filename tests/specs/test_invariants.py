"""specs.invariants: each predicate holds on valid states and catches its own corruption."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from kvpool.model import (
    APPEND,
    HASHLESS_FIRST,
    HASHLESS_FIRST_APPEND_UNCACHED,
    MEDIUM_GPU,
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockRemoved,
    CacheRequest,
    HashKey,
    PoolError,
    PoolState,
    Profile,
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    new_pool,
    reset_prefix_cache,
    take_events,
    touch,
)
from kvpool.specs.errors import InvariantViolation
from kvpool.specs.pool.invariants import (
    STATE_INVARIANTS,
    check_all,
    conservation,
    event_stream_consistency,
    free_list_membership,
    hash_map_consistency,
    lru_order,
    no_events_when_disabled,
    null_block,
    ref_counts_non_negative,
)
from tests.model.helpers import H0, H1, H2, Run

R = CacheRequest(block_hashes=(H0, H1, H2), all_token_ids=(10, 11, 12))
Z = (b"z", 0)


def valid_run() -> Run:
    """Six blocks, events on: 1 and 2 held and cached, 3 free and cached, 4 free
    hash-less (freed to the front), 5 free since construction; the events up to
    the free were taken, nothing is pending."""
    run = Run(new_pool(6, enable_events=True))
    run.do(get_new_blocks, 4)
    run.do(cache_full_blocks, R, [1, 2, 3], 0, 3, 1, 0)
    run.do(free_blocks, [3, 4])
    run.events()
    assert run.state.free_queue == (4, 5, 3)
    return run


VALID = valid_run()
STATE, HISTORY, TAKEN = VALID.state, VALID.history, VALID.taken


def set_block(state: PoolState, block_id: int, **changes: Any) -> PoolState:
    blocks = list(state.blocks)
    blocks[block_id] = replace(blocks[block_id], **changes)
    return replace(state, blocks=tuple(blocks))


def with_map(
    state: PoolState, changes: dict[HashKey, tuple[int, ...]], drop: tuple[HashKey, ...] = ()
) -> PoolState:
    cached = {k: v for k, v in state.cached.items() if k not in drop}
    cached.update(changes)
    return replace(state, cached=cached)


def assert_violates(
    name: str, predicate: Callable[..., str | None], fragment: str, state: PoolState, *extra: Any
) -> None:
    """The predicate gives a reason naming the branch, and check_all reports that invariant."""
    reason = predicate(state, *extra)
    assert reason is not None
    assert fragment in reason
    history = extra[0] if predicate is lru_order else HISTORY
    taken = extra[0] if predicate is event_stream_consistency else TAKEN
    with pytest.raises(InvariantViolation) as info:
        check_all(state, history, taken)
    assert info.value.name == name
    assert info.value.reason == reason


# --------------------------------------------------------------------------
# Positive: everything holds on valid states
# --------------------------------------------------------------------------


def test_the_valid_state_satisfies_every_invariant() -> None:
    for predicate in STATE_INVARIANTS:
        assert predicate(STATE) is None
    assert lru_order(STATE, HISTORY) is None
    assert event_stream_consistency(STATE, TAKEN) is None
    check_all(STATE, HISTORY, TAKEN)


def test_check_all_skips_lru_order_without_a_history() -> None:
    shuffled = replace(STATE, free_queue=(5, 4, 3))
    check_all(shuffled)
    with pytest.raises(InvariantViolation):
        check_all(shuffled, HISTORY)


def test_check_all_skips_event_consistency_without_the_taken_events() -> None:
    phantom = replace(STATE, pending_events=(BlockRemoved((b"z",), MEDIUM_GPU, 0),))
    check_all(phantom, HISTORY)
    with pytest.raises(InvariantViolation):
        check_all(phantom, HISTORY, TAKEN)


# --------------------------------------------------------------------------
# One corruption per invariant branch
# --------------------------------------------------------------------------


def test_ref_counts_non_negative_catches_a_negative_count() -> None:
    bad = set_block(STATE, 1, ref_cnt=-1)
    assert_violates("ref_counts_non_negative", ref_counts_non_negative, "negative", bad)


def test_free_list_membership_catches_a_block_queued_twice() -> None:
    bad = replace(STATE, free_queue=(4, 5, 3, 5))
    assert_violates("free_list_membership", free_list_membership, "more than once", bad)


def test_free_list_membership_catches_a_held_block_in_the_queue() -> None:
    bad = replace(STATE, free_queue=(4, 5, 3, 1))
    assert_violates("free_list_membership", free_list_membership, "is held", bad)


def test_free_list_membership_catches_a_leaked_free_block() -> None:
    bad = replace(STATE, free_queue=(4, 5))
    assert_violates("free_list_membership", free_list_membership, "leaked", bad)


def test_null_block_catches_the_null_block_in_the_free_queue() -> None:
    bad = replace(STATE, free_queue=(NULL_BLOCK_ID, 4, 5, 3))
    assert_violates("null_block", null_block, "free queue", bad)


def test_null_block_catches_a_hash_on_the_null_block() -> None:
    bad = with_map(set_block(STATE, 0, block_hash=Z, hash_num_tokens=1), {Z: (0,)})
    assert_violates("null_block", null_block, "carries hash keys", bad)


def test_null_block_catches_a_held_null_block() -> None:
    bad = set_block(STATE, 0, ref_cnt=1)
    assert_violates("null_block", null_block, "ref count", bad)


def test_null_block_catches_the_map_pointing_at_the_null_block() -> None:
    bad = with_map(STATE, {Z: (0,)})
    assert_violates("null_block", null_block, "hash map", bad)


def test_conservation_catches_a_phantom_block_in_the_free_queue() -> None:
    bad = replace(STATE, free_queue=(4, 5, 3, 99))
    assert free_list_membership(bad) is None
    assert_violates("conservation", conservation, "usable", bad)


def test_hash_map_consistency_catches_an_empty_entry() -> None:
    bad = with_map(STATE, {Z: ()})
    assert_violates("hash_map_consistency", hash_map_consistency, "empty", bad)


def test_hash_map_consistency_catches_an_entry_repeating_a_block() -> None:
    bad = with_map(STATE, {(H0, 0): (1, 1)})
    assert_violates("hash_map_consistency", hash_map_consistency, "repeats", bad)


def test_hash_map_consistency_catches_an_entry_pointing_at_an_unknown_block() -> None:
    bad = with_map(STATE, {(H0, 0): (1, 99)})
    assert_violates("hash_map_consistency", hash_map_consistency, "unknown block", bad)


def test_hash_map_consistency_catches_an_entry_pointing_at_a_block_without_the_key() -> None:
    bad = with_map(STATE, {Z: (2,)})
    assert_violates("hash_map_consistency", hash_map_consistency, "does not carry", bad)


def test_hash_map_consistency_catches_a_hash_without_token_count() -> None:
    bad = set_block(STATE, 1, hash_num_tokens=None)
    assert_violates("hash_map_consistency", hash_map_consistency, "token count", bad)


def test_hash_map_consistency_catches_a_token_count_without_hash() -> None:
    bad = set_block(STATE, 5, hash_num_tokens=3)
    assert_violates("hash_map_consistency", hash_map_consistency, "token count", bad)


def test_hash_map_consistency_catches_partial_keys_without_a_primary_key() -> None:
    bad = with_map(set_block(STATE, 4, partial_keys=(Z,)), {Z: (4,)})
    assert_violates("hash_map_consistency", hash_map_consistency, "no primary key", bad)


def test_hash_map_consistency_catches_a_block_carrying_a_key_twice() -> None:
    bad = set_block(STATE, 1, partial_keys=((H0, 0),))
    assert_violates("hash_map_consistency", hash_map_consistency, "carries a key twice", bad)


def test_hash_map_consistency_catches_a_key_the_map_does_not_lead_back_from() -> None:
    bad = with_map(STATE, {}, drop=((H2, 0),))
    assert_violates("hash_map_consistency", hash_map_consistency, "does not lead", bad)


def test_hash_map_consistency_catches_entries_in_a_pool_without_caching() -> None:
    bad = replace(STATE, config=replace(STATE.config, enable_caching=False))
    assert_violates("hash_map_consistency", hash_map_consistency, "without prefix caching", bad)


def test_no_events_when_disabled_catches_a_queued_event() -> None:
    bad = replace(
        STATE,
        config=replace(STATE.config, enable_events=False),
        pending_events=(AllBlocksCleared(),),
    )
    assert_violates("no_events_when_disabled", no_events_when_disabled, "queued", bad)


def test_lru_order_catches_a_queue_in_the_wrong_order() -> None:
    bad = replace(STATE, free_queue=(5, 4, 3))
    assert_violates("lru_order", lru_order, "free-order rule", bad, HISTORY)


def test_lru_order_catches_a_block_that_entered_the_queue_without_a_free() -> None:
    bad = replace(set_block(STATE, 2, ref_cnt=0), free_queue=(4, 5, 3, 2))
    history = HISTORY.observe(STATE, bad)
    assert history.unexplained == frozenset({2})
    assert_violates("lru_order", lru_order, "without a free", bad, history)


def test_lru_order_catches_a_history_that_disagrees_on_the_free_set() -> None:
    bad = replace(set_block(STATE, 2, ref_cnt=0), free_queue=(4, 5, 3, 2))
    assert_violates("lru_order", lru_order, "disagree", bad, HISTORY)


def test_event_stream_consistency_catches_a_stream_that_drifted_from_the_map() -> None:
    assert_violates("event_stream_consistency", event_stream_consistency, "describe", STATE, ())


def test_event_stream_consistency_catches_a_removal_of_something_never_stored() -> None:
    removal = BlockRemoved((b"z",), MEDIUM_GPU, 0)
    bad = replace(STATE, pending_events=(removal,))
    assert_violates(
        "event_stream_consistency", event_stream_consistency, "never stored", bad, TAKEN
    )


def test_event_stream_consistency_is_vacuous_with_events_disabled() -> None:
    state = replace(STATE, config=replace(STATE.config, enable_events=False))
    assert event_stream_consistency(state, ()) is None


def test_violation_message_names_the_invariant_and_dumps_the_state() -> None:
    bad = replace(STATE, free_queue=(4, 5))
    with pytest.raises(InvariantViolation) as info:
        check_all(bad)
    message = str(info.value)
    assert "free_list_membership" in message
    assert "leaked" in message
    assert "free queue" in message
    assert "hash map:" in message
    assert "block 1: ref_cnt=1" in message


def test_violation_is_an_assertion_error() -> None:
    assert issubclass(InvariantViolation, AssertionError)


# --------------------------------------------------------------------------
# Property: every invariant holds along any sequence of operations
# --------------------------------------------------------------------------

HASHES = st.sampled_from([b"a", b"b", b"c"])
PROFILES = st.sampled_from([HASHLESS_FIRST, APPEND, HASHLESS_FIRST_APPEND_UNCACHED])


def random_step(run: Run, data: st.DataObject) -> None:
    """One operation, with valid-looking arguments except on one step in six."""
    state = run.state
    n = state.config.num_blocks
    hbs = state.config.hash_block_size
    junk = data.draw(st.integers(0, 5)) == 0
    held_ids = [b for b, blk in enumerate(state.blocks) if blk.ref_cnt > 0]
    if junk or not held_ids:
        some_ids = st.lists(st.integers(-1, n), max_size=4)
        distinct_held = some_held = some_ids
        group = data.draw(st.integers(-1, 1))
    else:
        some_ids = st.lists(st.integers(0, n - 1), max_size=4)
        some_held = st.lists(st.sampled_from(held_ids), max_size=4)
        distinct_held = st.lists(st.sampled_from([NULL_BLOCK_ID, *held_ids]), unique=True)
        group = data.draw(st.integers(0, 1))
    request = CacheRequest(tuple(data.draw(st.lists(HASHES, min_size=4, max_size=8))))
    op = data.draw(st.integers(0, 9))
    call: tuple[Callable[..., Any], *tuple[object, ...]]
    if op == 0:
        call = (get_new_blocks, data.draw(st.integers(-junk, len(state.free_queue) + junk)))
    elif op == 1:
        call = (touch, data.draw(some_ids))
    elif op in (2, 3):
        call = (free_blocks, data.draw(some_held))
    elif op in (4, 5):
        blocks = data.draw(distinct_held)
        lo = data.draw(st.integers(-junk, len(blocks)))
        hi = data.draw(st.integers(max(lo, 0), len(blocks) + junk))
        size = hbs * data.draw(st.sampled_from([1, 1, 2]))
        mask = data.draw(st.none() | st.lists(st.booleans(), min_size=hi - lo, max_size=hi - lo))
        call = (cache_full_blocks, request, blocks, lo, hi, size, group, mask)
    elif op == 6:
        one_held = st.sampled_from(held_ids) if held_ids else st.integers(-1, n)
        block = data.draw(one_held)
        size = hbs * data.draw(st.sampled_from([1, 2, 3, 3]))
        tokens = data.draw(st.integers(-1, 4 * hbs) if junk else st.sampled_from([hbs, 2 * hbs]))
        call = (cache_partial_block, request, block, tokens, group, size)
    elif op == 7:
        call = (evict_blocks, data.draw(some_ids))
    elif op == 8:
        call = (reset_prefix_cache,)
    else:
        call = (take_events,)
    before = run.state
    snapshot = replace(before, cached=dict(before.cached))  # the only mutable part
    try:
        run.do(*call)
        event(f"{call[0].__name__} accepted")
    except PoolError as error:
        event(f"{call[0].__name__} rejected: {type(error).__name__}")
        assert run.state is before
    assert before == snapshot  # accepted or not, the input state was not mutated
    run.ask(get_cached_block, data.draw(HASHES), [0, 1])


@given(
    st.integers(1, 8),
    st.sampled_from([True, True, True, False]),
    st.sampled_from([1, 2]),
    st.booleans(),
    PROFILES,
    st.data(),
)
def test_every_invariant_holds_along_random_operation_sequences(
    num_blocks: int, caching: bool, hbs: int, events: bool, profile: Profile, data: st.DataObject
) -> None:
    run = Run(new_pool(num_blocks, caching, hbs, events, profile))
    for _ in range(data.draw(st.integers(1, 25))):
        random_step(run, data)
