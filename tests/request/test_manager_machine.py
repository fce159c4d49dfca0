"""The request-level machine: the model is safe, the impl conforms, and planted bugs are found.

Planted bugs are searched for without Hypothesis' shrinking phase: finding
them takes seconds, shrinking the request-level programs takes minutes.
"""

from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheManager
from kvpool.model import PROFILES
from kvpool.specs.errors import InvariantViolation
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import ManagerDivergence, manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import HYBRID_LAYOUTS, LAYOUTS
from kvpool.specs.targets.impl.request import ImplManagerTarget
from tests.request.planted_bugs import BUGS, target_of


def run(machine: type, max_examples: int, shrink: bool = True) -> None:
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=max_examples,
        stateful_step_count=40,
        report_multiple_bugs=False,
        phases=phases,
    )
    run_state_machine_as_test(machine, settings=chosen)


def test_the_model_never_serves_wrong_kv() -> None:
    """The model alone, checked only against the ground truth and the pool's invariants."""
    run(manager_machine(ModelManagerTarget, lockstep=False), max_examples=200)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_impl_conforms_in_lock_step_with_the_model(layout: str) -> None:
    machine = manager_machine(ImplManagerTarget, layouts=[layout], profiles=list(PROFILES.values()))
    run(machine, max_examples=100)


FOUND_BY = {
    "touch-before-capacity-check": ("ref_counts_match_tables", None),
    "pop-new-before-touching-hits": ("requests_read_their_own_kv", None),
    "null-block-counted-evictable": (None, "allocate_slots"),
    "eagle-drop-twice": (None, "get_computed_blocks"),
    "caches-blocks-not-yet-computed": ("cached_blocks_hold_their_prefix", None),
}
"""Per bug: the safety property that catches it with no model (None: the bug is not
unsafe, it only wastes or refuses capacity), or the call where lock-step shows it."""

LAYOUTS_OF = {
    "null-block-counted-evictable": ["sliding_window", "chunked_local"],
    "eagle-drop-twice": ["full"],
}
"""Bugs that only exist in some layouts are searched for there."""


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_lock_step_finds_each_planted_bug(bug: str) -> None:
    layouts = LAYOUTS_OF.get(bug, LAYOUTS)
    machine = manager_machine(target_of(BUGS[bug]), layouts=layouts, name=f"Bug_{bug}")
    with pytest.raises((ManagerDivergence, RequestInvariantViolation, InvariantViolation)):
        run(machine, max_examples=2000, shrink=False)


@pytest.mark.parametrize("bug", sorted(b for b, (prop, _) in FOUND_BY.items() if prop))
def test_the_ground_truth_alone_finds_each_unsafe_bug(bug: str) -> None:
    """No model at all: the bug breaks the safety property named in FOUND_BY."""
    machine = manager_machine(target_of(BUGS[bug]), lockstep=False, name=f"Unsafe_{bug}")
    with pytest.raises(RequestInvariantViolation) as info:
        run(machine, max_examples=2000, shrink=False)
    assert info.value.name == FOUND_BY[bug][0]


@pytest.mark.parametrize("layout", HYBRID_LAYOUTS)
def test_impl_conforms_on_the_level_2_hybrids(layout: str) -> None:
    machine = manager_machine(ImplManagerTarget, layouts=[layout], level=2)
    run(machine, max_examples=100)


def test_impl_conforms_at_level_2() -> None:
    run(manager_machine(ImplManagerTarget, level=2), max_examples=150)


class AcceptsZeroNewTokens(KVCacheManager):
    """Lets ``allocate_slots(request, 0)`` through; no scheduler sends it, so level 1 never does."""

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if num_new_tokens == 0:
            return self.empty_kv_cache_blocks
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class SameSpecGroupsDisagree(KVCacheManager):
    """The second of two same-spec groups returns one block fewer: only a layout with
    two groups of one spec (level 2's hybrids) can show it."""

    def find_longest_cache_hit(self, block_hashes: Any, max_length: int) -> Any:
        blocks, length = super().find_longest_cache_hit(block_hashes, max_length)
        if len(blocks) == 3 and blocks[0]:
            blocks = (blocks[0], blocks[0][:-1], blocks[2])
        return blocks, length


@pytest.mark.parametrize(
    ("bug", "layouts"),
    [(AcceptsZeroNewTokens, LAYOUTS), (SameSpecGroupsDisagree, ["full+full+sliding_window"])],
    ids=["accepts-zero-new-tokens", "same-spec-groups-disagree"],
)
def test_level_2_finds(bug: type[KVCacheManager], layouts: list[str]) -> None:
    machine = manager_machine(target_of(bug), layouts=layouts, level=2, name=f"L2_{bug.__name__}")
    with pytest.raises((ManagerDivergence, RequestInvariantViolation, InvariantViolation)):
        run(machine, max_examples=1000, shrink=False)
