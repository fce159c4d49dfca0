"""HiSparse slice 1 in the request layer's kit: the model target, kvpool.impl and vLLM 0.33
against the model, planted bugs.

The model target must conform to itself; vLLM 0.33.0's manager and coordinator must
conform on ``hisparse_scope()`` (skipped, visibly, without vLLM; an error under
``KVPOOL_REQUIRE_VLLM=1``); targets that get the workers' acknowledgements wrong must be
found; slice 1's invariants must catch a broken state.
"""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import pytest

from kvpool.impl import KVCacheManager
from kvpool.impl.hisparse_view import HiSparseCoordinatorView
from kvpool.model import hisparse as model_hisparse
from kvpool.model import manager as model_manager
from kvpool.model.request import new_request
from kvpool.specs.request.check import narrowed, run_request_conformance
from kvpool.specs.request.hisparse_invariants import (
    durable_prefix_is_clean,
    pools_keep_their_invariants,
    published_below_ready_prefix,
    ref_counts_add_up,
    transfers_hold_their_blocks,
)
from kvpool.specs.request.hisparse_machine import hisparse_setup
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import HISPARSE_PART, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget


def test_the_model_target_conforms_to_itself() -> None:
    report = run_request_conformance(
        ManagerTargetSpec(ModelManagerTarget, **HISPARSE_PART),
        hypothesis_profile="ci",
        max_examples=60,
    )
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 60


def test_a_scope_without_the_switch_is_not_drawn_hisparse() -> None:
    assert not ManagerTargetSpec(ModelManagerTarget).hisparse
    claimed = narrowed(ManagerTargetSpec(ModelManagerTarget, hisparse=True), {"hisparse": False})
    assert not claimed.hisparse


class OneWorkerOnly(ModelManagerTarget):
    """Planted: every transfer counted as run by one worker, the second ignored."""

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        super().update_spills({t: 1 for t in enqueued}, completed)


class PublishesOnEnqueue(ModelManagerTarget):
    """Planted: a transfer handed to the workers counts as written back at once."""

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        super().update_spills(enqueued, {**completed, **enqueued})


@pytest.mark.parametrize("bug", [OneWorkerOnly, PublishesOnEnqueue])
def test_a_planted_bug_is_found(bug: type[ModelManagerTarget]) -> None:
    report = run_request_conformance(
        ManagerTargetSpec(bug, **HISPARSE_PART),
        hypothesis_profile="ci",
        max_examples=200,
        shrink=False,
    )
    assert not report.conforms
    assert report.exit_code == 1, report.failure


def _written_back_once() -> model_manager.KVCacheManagerState:
    """A request of four pages, scheduled, its transfers handed out, page 0 acknowledged."""
    setup = hisparse_setup(32, 16)
    state = ModelManagerTarget(setup).state
    request = new_request("a", list(range(64)), 16)
    state, blocks = model_manager.allocate_slots(state, request, 64)
    assert blocks is not None
    state, _ = model_hisparse.advance_scheduled(state, [("a", 64)])
    state, transfers = model_hisparse.build_offload_command(state)
    assert len(transfers) == 4
    state, _ = model_hisparse.update_spills(state, {0: 1}, {0: 1})
    return state


def test_the_invariants_hold_on_a_written_back_page() -> None:
    state = _written_back_once()
    assert state.hisparse is not None
    assert state.hisparse.books["a"].ready_prefix_pages == 1
    transfers_hold_their_blocks(state)
    durable_prefix_is_clean(state)
    published_below_ready_prefix(state)
    pools_keep_their_invariants(state)
    ref_counts_add_up(state)


def test_a_reference_count_without_a_holder_is_caught() -> None:
    state = _written_back_once()
    blocks = list(state.managers.pool.blocks)
    held = next(i for i, b in enumerate(blocks) if i and b.ref_cnt)
    blocks[held] = replace(blocks[held], ref_cnt=blocks[held].ref_cnt + 1)
    pool = replace(state.managers.pool, blocks=tuple(blocks))
    broken = replace(state, managers=replace(state.managers, pool=pool))
    with pytest.raises(AssertionError, match="holders add up"):
        ref_counts_add_up(broken)


def test_a_transfer_whose_host_block_is_free_is_caught() -> None:
    state = _written_back_once()
    assert state.host_pool is not None and state.hisparse is not None
    host_block = next(iter(state.hisparse.transfers.values())).host_block
    blocks = list(state.host_pool.blocks)
    blocks[host_block] = replace(blocks[host_block], ref_cnt=0)
    broken = replace(state, host_pool=replace(state.host_pool, blocks=tuple(blocks)))
    with pytest.raises(AssertionError, match="pending transfers"):
        transfers_hold_their_blocks(broken)


def test_a_page_published_past_the_ready_prefix_is_caught() -> None:
    state = _written_back_once()
    assert state.hisparse is not None
    book = state.hisparse.books["a"]
    early = replace(book, ready_prefix_pages=0, valid=frozenset())
    broken = replace(state, hisparse=replace(state.hisparse, books={"a": early}))
    with pytest.raises(AssertionError, match="is published"):
        published_below_ready_prefix(broken)


@pytest.mark.usefixtures("require_vllm_manager")
def test_vllm_conforms_on_hisparse_scope() -> None:
    from kvpool.specs.targets.vllm.request import hisparse_scope

    report = run_request_conformance(hisparse_scope(), hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


@pytest.mark.usefixtures("require_vllm_manager")
def test_a_planted_bug_over_vllm_is_found() -> None:
    """vLLM's coordinator told of one worker where two run a transfer: it publishes after
    the first completion, the model after both."""
    from kvpool.specs.targets.vllm.hisparse import VllmHiSparseTarget

    class OneWorkerOverVllm(VllmHiSparseTarget):
        def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
            super().update_spills({t: 1 for t in enqueued}, completed)

    report = run_request_conformance(
        ManagerTargetSpec(OneWorkerOverVllm, **HISPARSE_PART),
        hypothesis_profile="ci",
        max_examples=200,
        shrink=False,
    )
    assert not report.conforms
    assert report.exit_code == 1, report.failure
    assert "update_spills" in (report.program or "")


# ----------------------------------------------------------------------
# kvpool.impl in lock-step with the model
# ----------------------------------------------------------------------


def test_the_impl_conforms_on_hisparse() -> None:
    """kvpool.impl's manager and ``get_hisparse_coordinator``'s view against the model,
    compared after every call (``ImplManagerTarget`` answers ``ManagerTargetHiSparse``)."""
    report = run_request_conformance(
        ManagerTargetSpec(ImplManagerTarget, **HISPARSE_PART),
        hypothesis_profile="ci",
        max_examples=150,
    )
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 150


class _OneWorkerCoordinator:
    """The impl's coordinator, told of one worker where two run a transfer (a wrapper: the
    compiled coordinator takes no interpreted subclass)."""

    def __init__(self, view: HiSparseCoordinatorView) -> None:
        self._view = view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        # BUG: the first worker's completion completes the transfer
        self._view.update_spills({t: 1 for t in enqueued}, completed)


class FirstOfTwoWorkersImpl(ImplManagerTarget):
    """Planted in the impl's coordinator: a spill completes on the first of two workers."""

    def coordinator(self) -> HiSparseCoordinatorView:
        return cast(HiSparseCoordinatorView, _OneWorkerCoordinator(super().coordinator()))


class _Preempted:
    """A request that says it has not finished, whatever it is."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def is_finished(self) -> bool:
        return False


class PreemptsEveryFree(KVCacheManager):
    """Planted in the impl's manager: every free drops the request's publication, as a
    preemption does, so a finished request's durable prefix is never published."""

    def free(self, request: Any) -> None:
        super().free(_Preempted(request))  # BUG: ignores request.is_finished()


class PreemptsEveryFreeImpl(ImplManagerTarget):
    manager_class = PreemptsEveryFree


@pytest.mark.parametrize(
    ("bug", "evidence", "shrink"),
    [
        # found at programs 3 to 21 over seeds: a short program as found shows the spill
        (FirstOfTwoWorkersImpl, "update_spills", False),
        # found at program 231 of ci's sample once hot regions are drawn too (slice 2): shrunk,
        # the program is a write-back in flight and the finished request's free
        (PreemptsEveryFreeImpl, "finished=True", True),
    ],
)
def test_a_planted_impl_bug_is_found_in_lock_step(
    bug: type[ImplManagerTarget], evidence: str, shrink: bool
) -> None:
    report = run_request_conformance(
        ManagerTargetSpec(bug, **HISPARSE_PART),
        hypothesis_profile="ci",
        max_examples=600,
        shrink=shrink,
    )
    assert not report.conforms
    assert report.exit_code == 1, report.failure
    assert evidence in (report.program or ""), report.program
