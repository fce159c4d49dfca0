"""Every v0 invariant holds on valid states and fails on a hand-corrupted one."""

from collections.abc import Callable
from dataclasses import replace

import pytest

from kvpool.model.v0 import BlockHandle, EvictorEntry, V0State
from kvpool.specs.v0 import invariants as inv
from kvpool.specs.v0.invariants import V0InvariantViolation, check_all, dump_v0_state
from tests.v0.helpers import shared_prefix_state

# The valid state: block 0 (AB) held by #0 and #2, block 1 held by #1 (C_),
# block 2 evictable (XY), block 3 hash-less free.


def _block(state: V0State, block_id: int, **changes: object) -> V0State:
    blocks = list(state.blocks)
    blocks[block_id] = replace(blocks[block_id], **changes)  # type: ignore[arg-type]
    return replace(state, blocks=tuple(blocks))


def _handle(state: V0State, handle: int, **changes: object) -> V0State:
    handles = dict(state.handles)
    handles[handle] = replace(handles[handle], **changes)  # type: ignore[arg-type]
    return replace(state, handles=handles)


def _second_copy(state: V0State) -> V0State:
    """#2 (AB) on its own block 3 instead of sharing block 0, as if promotion skipped the cache."""
    state = replace(_handle(state, 2, block_id=3), hashless_free=())
    return _block(_block(state, 0, ref_cnt=1), 3, ref_cnt=1)


def test_the_valid_state_satisfies_every_invariant_and_the_property() -> None:
    state = shared_prefix_state()
    check_all(state)
    assert inv.cached_prefix_closed(state) is None


CORRUPTIONS: list[tuple[Callable[[V0State], str | None], str, Callable[[V0State], V0State]]] = [
    (
        inv.no_duplicate_content,
        "the same content cached on a second block (de-duplication skipped)",
        _second_copy,
    ),
    (
        inv.no_duplicate_content,
        "one block cached under two hashes",
        lambda s: replace(s, cached={**s.cached, (9, 9): 0}),
    ),
    (
        inv.no_duplicate_content,
        "a mutable block object writing into a cached block",
        lambda s: _handle(s, 1, block_id=0),
    ),
    (
        inv.ref_counts_match_holders,
        "a ref count one too high (a leak)",
        lambda s: _block(s, 0, ref_cnt=3),
    ),
    (
        inv.ref_counts_match_holders,
        "a ref count one too low (freed under a reader)",
        lambda s: _block(s, 1, ref_cnt=0),
    ),
    (
        inv.copy_on_write_isolation,
        "two sequences appended into one block without a copy",
        lambda s: _block(
            replace(
                s,
                handles={
                    **s.handles,
                    7: BlockHandle(block_id=1, prev=2, token_ids=(68,)),
                },
                next_handle=8,
            ),
            1,
            ref_cnt=2,
        ),
    ),
    (
        inv.evictor_holds_unused_cached,
        "a held block in the evictor",
        lambda s: replace(s, evictor={**s.evictor, 0: EvictorEntry((65, 66), 2, -1)}),
    ),
    (
        inv.evictor_holds_unused_cached,
        "an unused cached block missing from the evictor (leaked)",
        lambda s: replace(s, evictor={}),
    ),
    (
        inv.evictor_holds_unused_cached,
        "an evictor entry naming other content",
        lambda s: replace(
            s,
            evictor={2: EvictorEntry((65, 66), 2, -1)},
        ),
    ),
    (
        inv.free_memory_accounting,
        "a block both hash-less free and evictable",
        lambda s: replace(s, hashless_free=(3, 2)),
    ),
    (
        inv.free_memory_accounting,
        "a block queued twice",
        lambda s: replace(s, hashless_free=(3, 3)),
    ),
    (
        inv.free_memory_accounting,
        "a block nowhere (leaked)",
        lambda s: replace(s, hashless_free=()),
    ),
    (
        inv.unheld_blocks_are_reset,
        "a free block keeping its last access",
        lambda s: _block(s, 3, last_accessed=4.0),
    ),
    (
        inv.block_objects_well_formed,
        "a full block object without a content hash",
        lambda s: _handle(s, 1, token_ids=(67, 68)),
    ),
    (
        inv.block_objects_well_formed,
        "a content hash that does not end with the block's tokens",
        lambda s: _handle(s, 0, content_hash=(65, 67)),
    ),
    (
        inv.cached_prefix_closed,
        "a cached block whose prefix is not cached",
        lambda s: replace(
            s,
            cached={**s.cached, (1, 2, 3, 4): 2},
            evictor={2: EvictorEntry((1, 2, 3, 4), 4, -1)},
        ),
    ),
]


@pytest.mark.parametrize(
    ("invariant", "what", "corrupt"), CORRUPTIONS, ids=[what for _, what, _ in CORRUPTIONS]
)
def test_each_invariant_catches_its_corruption(
    invariant: Callable[[V0State], str | None],
    what: str,
    corrupt: Callable[[V0State], V0State],
) -> None:
    state = shared_prefix_state()
    assert invariant(state) is None
    broken = corrupt(state)
    reason = invariant(broken)
    assert reason is not None, what


def test_every_invariant_has_a_corruption_that_breaks_it() -> None:
    covered = {invariant for invariant, _, _ in CORRUPTIONS}
    assert set(inv.STATE_INVARIANTS) <= covered


def test_check_all_names_the_broken_invariant_and_dumps_the_state() -> None:
    broken = _block(shared_prefix_state(), 0, ref_cnt=5)
    with pytest.raises(V0InvariantViolation) as raised:
        check_all(broken)
    assert raised.value.name == "ref_counts_match_holders"
    assert "ref_cnt=5" in str(raised.value)
    assert "block objects:" in dump_v0_state(broken)
