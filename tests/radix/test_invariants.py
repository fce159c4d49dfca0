"""Every radix invariant, and every engine-neutral property it applies, fails when broken."""

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvpool.model import BlockRemoved, BlockStored
from kvpool.model import radix as r
from kvpool.model.radix import RadixState
from kvpool.specs import prefix_cache
from kvpool.specs.radix import invariants as inv
from kvpool.specs.radix.invariants import RadixInvariantViolation, check_all, check_tree


def state() -> RadixState:
    s = r.new_radix_cache(2)
    s, _ = r.insert(s, [1, 2, 3, 4], [10, 11, 12, 13])
    s, _ = r.insert(s, [1, 2, 5, 6], [20, 21, 22, 23])
    s, _ = r.lock(s, (1, 2, 5, 6))
    return s


def node(s: RadixState, path: tuple[int, ...], **changes: object) -> RadixState:
    nodes = dict(s.nodes)
    nodes[path] = replace(nodes[path], **changes)  # type: ignore[arg-type]
    return replace(s, nodes=nodes)


def test_a_valid_state_passes_every_invariant() -> None:
    s = state()
    for invariant in inv.STATE_INVARIANTS:
        assert invariant(s) is None
    check_all(s)
    check_tree(r.tree_view(s), 2, evictable=2, protected=4, truth=TRUTH)


TRUTH = {10: (1,), 11: (1, 2), 12: (1, 2, 3), 13: (1, 2, 3, 4), 22: (1, 2, 5), 23: (1, 2, 5, 6)}

CORRUPTIONS: list[
    tuple[Callable[[RadixState], object], str, Callable[[RadixState], RadixState]]
] = [
    (inv.tree_well_formed, "an orphan", lambda s: node(s, (1, 2, 3, 4), parent=(7, 7))),
    (inv.tree_well_formed, "a parent that is no prefix", lambda s: node(s, (1, 2), parent=(1, 2))),
    (inv.tree_well_formed, "half a page", lambda s: node(s, (1, 2), parent=(1,))),
    (inv.tree_well_formed, "a slot missing", lambda s: node(s, (1, 2), slots=(10,))),
    (
        inv.tree_well_formed,
        "two children on one page",
        lambda s: replace(
            s, nodes={**s.nodes, (1, 2, 3, 4, 7, 7): r.RadixNode((1, 2), (30, 31, 32, 33))}
        ),
    ),
    (
        inv.lock_refs_cover_descendants,
        "a negative count",
        lambda s: node(s, (1, 2, 3, 4), lock_ref=-1),
    ),
    (
        inv.lock_refs_cover_descendants,
        "a parent below its child",
        lambda s: node(s, (1, 2), lock_ref=0),
    ),
    (
        inv.stamps_from_the_past,
        "a stamp from the future",
        lambda s: node(s, (1, 2), last_access=99),
    ),
    (inv.stamps_from_the_past, "accessed before created", lambda s: node(s, (1, 2), created=4)),
]


@pytest.mark.parametrize(
    ("invariant", "what", "corrupt"), CORRUPTIONS, ids=[what for _, what, _ in CORRUPTIONS]
)
def test_each_tree_invariant_catches_its_corruption(
    invariant: Callable[[RadixState], object],
    what: str,
    corrupt: Callable[[RadixState], RadixState],
) -> None:
    bad = corrupt(state())
    assert invariant(bad) is not None
    with pytest.raises(RadixInvariantViolation):
        check_all(bad)


def test_an_event_stream_that_drifted_fails_event_stream_consistency() -> None:
    s = replace(state(), pending_events=())
    with pytest.raises(RadixInvariantViolation, match="event_stream_consistency"):
        check_all(s)


def test_a_stored_page_whose_parent_is_gone_fails_cached_prefix_closed() -> None:
    s = state()
    parent_pages = r.page_hashes((1, 2), 2)
    stale = BlockRemoved(parent_pages, "GPU", 0)
    stored = BlockStored(parent_pages, None, (1, 2), 2, None, "GPU", None, None, 0)
    # remove the shared page, store it again: the fold is right, the link is gone
    s = replace(
        s, pending_events=(*s.pending_events, stale, replace(stored, parent_block_hash=b"x"))
    )
    parents = prefix_cache.stored_parents(s.pending_events)
    assert prefix_cache.cached_prefix_closed(parents) is not None
    with pytest.raises(RadixInvariantViolation, match="cached_prefix_closed"):
        check_all(s)


def test_a_tree_with_a_hole_fails_cached_prefix_closed() -> None:
    view = (((1, 2, 3, 4), (12, 13)),)  # the node's slots start at token 2: (1, 2) missing
    with pytest.raises(RadixInvariantViolation, match="cached_prefix_closed"):
        check_tree(view, 2, evictable=2, protected=0, truth=TRUTH)


def test_sizes_that_do_not_add_up_fail_size_accounting() -> None:
    with pytest.raises(RadixInvariantViolation, match="size_accounting"):
        check_tree(r.tree_view(state()), 2, evictable=2, protected=3, truth=TRUTH)


def test_a_path_holding_another_prefix_s_kv_fails_hit_serves_inserted_tokens() -> None:
    wrong = {**TRUTH, 13: (1, 2, 3, 9)}
    with pytest.raises(RadixInvariantViolation, match="hit_serves_inserted_tokens"):
        check_tree(r.tree_view(state()), 2, evictable=2, protected=4, truth=wrong)


def test_the_target_s_events_are_folded_after_a_take() -> None:
    s = state()
    view = r.tree_view(s)
    check_tree(view, 2, evictable=2, protected=4, truth=TRUTH, taken=s.pending_events)
    with pytest.raises(RadixInvariantViolation, match="event_stream_consistency"):
        check_tree(view, 2, evictable=2, protected=4, truth=TRUTH, taken=s.pending_events[:2])


def test_cached_pages_count_each_node_s_own_pages() -> None:
    pages = inv.cached_pages(r.tree_view(state()), 2)
    shared = {(h, 0) for p in ((1, 2, 3, 4), (1, 2, 5, 6)) for h in r.page_hashes(p, 2)}
    assert len(shared) == 3  # (1, 2) is shared
    assert pages == Counter(dict.fromkeys(shared, 1))


def test_locked_data_never_freed_names_the_slots() -> None:
    assert prefix_cache.locked_data_never_freed([1, 2], {2}) is not None
    assert prefix_cache.locked_data_never_freed([1], {2}) is None
