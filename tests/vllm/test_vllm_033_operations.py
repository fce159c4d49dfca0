"""vLLM 0.33's BlockPool in full: the machine calls every public method, and finds bugs in them."""

import inspect
import re
from collections import Counter
from typing import Any

import pytest

from kvpool.specs.conformance import run_conformance
from kvpool.specs.targets.vllm.pool import VllmTargetFactory, load_vllm

pytestmark = pytest.mark.usefixtures("require_vllm")


def public_methods(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}


def counting_pool(calls: Counter[str]) -> type:
    """vLLM's BlockPool with every public method counting its calls."""
    base = load_vllm().pool_class

    def wrap(name: str) -> Any:
        method = getattr(base, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return method(self, *args, **kwargs)

        return counted

    return type("CountingPool", (base,), {n: wrap(n) for n in public_methods(base)})


@pytest.mark.parametrize("level", [1, 2])
def test_the_machine_calls_every_public_method_of_the_installed_block_pool(level: int) -> None:
    api = load_vllm()
    if not api.unpin_blocks:
        pytest.skip(f"vLLM {api.version} predates 0.33's BlockPool operations")
    calls: Counter[str] = Counter()
    factory = VllmTargetFactory(counting_pool(calls))
    # Level 2 stops at vLLM's first known finding; a suppressed finding is stepped over.
    if level == 2:
        factory = VllmTargetFactory(counting_pool(calls), suppress=_all_findings())
    run_conformance(factory, level=level, hypothesis_profile="ci", max_examples=150)
    never = public_methods(api.pool_class) - set(calls)
    assert not never, f"the level-{level} machine never calls {sorted(never)}"


def _all_findings() -> list[str]:
    from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS

    return list(KNOWN_FINDINGS)


@pytest.mark.parametrize(
    ("pool_class", "evidence"),
    [
        ("SilentWatcherPool", "pending reuses"),
        ("NoisyMovePool", "BlockStored"),
        ("SourceStillReachablePool", "move_block_hashes|relocate"),
    ],
)
def test_a_planted_bug_in_a_033_operation_is_found(pool_class: str, evidence: str) -> None:
    report = run_conformance(
        VllmTargetFactory(f"tests.vllm.buggy_pools:{pool_class}"),
        level=1,
        hypothesis_profile="ci",
        max_examples=300,
        shrink=False,  # found is what matters; shrinking costs more than finding
    )
    assert not report.conforms
    assert report.failure_kind in {"divergence", "invariant"}, report.failure
    found = (report.failure or "") + (report.program or "")
    assert any(word in found for word in evidence.split("|")), report.failure


# --------------------------------------------------------------------------
# The request layer: what vLLM 0.33's scheduler calls on its KVCacheManager
# --------------------------------------------------------------------------


def scheduler_calls() -> set[str]:
    """The public ``KVCacheManager`` methods vLLM's own scheduler calls, read from its source."""
    import vllm.v1.core.sched.scheduler as scheduler
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    called = set(re.findall(r"kv_cache_manager\.(\w+)\(", inspect.getsource(scheduler)))
    return called & public_methods(KVCacheManager)


def outside_calls_counting_manager(calls: Counter[str]) -> type:
    """vLLM's KVCacheManager counting the public calls made from outside it (by the adapter)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    depth = [0]

    def wrap(name: str) -> Any:
        method = getattr(KVCacheManager, name)

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                calls[name] += 1
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    methods = {n: wrap(n) for n in public_methods(KVCacheManager)}
    return type("CountingManager", (KVCacheManager,), methods)


def test_every_scheduler_call_on_the_manager_is_driven_or_listed_with_a_reason() -> None:
    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.targets.vllm.request import (
        SCHEDULER_CALLS_NOT_DRIVEN,
        VllmManagerFactory,
        fine_grained_scope,
        scope,
    )

    expected = scheduler_calls()
    if "take_kv_cache_block_copies" not in expected:
        pytest.skip("the installed vLLM predates 0.33's KVCacheManager")
    calls: Counter[str] = Counter()
    factory = VllmManagerFactory(outside_calls_counting_manager(calls))
    for chosen in (scope(factory), fine_grained_scope(factory)):
        report = run_request_conformance(chosen, hypothesis_profile="ci", max_examples=150)
        assert report.conforms, report.failure
    unexplained = expected - set(calls) - set(SCHEDULER_CALLS_NOT_DRIVEN)
    assert not unexplained, f"the request machine never calls {sorted(unexplained)}"
    stale = set(SCHEDULER_CALLS_NOT_DRIVEN) & set(calls)
    assert not stale, f"listed as not driven, but called: {sorted(stale)}"
    assert set(SCHEDULER_CALLS_NOT_DRIVEN) <= expected, "a listed method the scheduler never calls"


def test_the_docs_list_every_scheduler_call_not_driven() -> None:
    from pathlib import Path

    from kvpool.specs.targets.vllm.request import SCHEDULER_CALLS_NOT_DRIVEN

    page = (Path(__file__).parents[2] / "docs" / "vllm-conformance.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \| .* \|$", page, re.MULTILINE))
    assert set(SCHEDULER_CALLS_NOT_DRIVEN) <= rows


def test_vllm_copies_on_write_as_the_model_does() -> None:
    """vLLM 0.33's fine-grained hits and copy-on-write, compared call by call; programs copy."""
    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.targets.vllm.request import (
        VllmHashingManagerTarget,
        VllmManagerFactory,
        fine_grained_scope,
    )

    copies = [0]

    class Counting(VllmHashingManagerTarget):
        def take_kv_cache_block_copies(self) -> Any:
            taken = super().take_kv_cache_block_copies()
            copies[0] += len(taken[0])
            return taken

    class Factory(VllmManagerFactory):
        def __call__(self, setup: Any) -> Any:
            return Counting(setup, self.manager_class(), "vllm")

    report = run_request_conformance(
        fine_grained_scope(Factory()), hypothesis_profile="ci", max_examples=100
    )
    assert report.conforms, report.failure
    assert copies[0] > 0


def test_a_vllm_copy_served_before_it_is_written_is_found() -> None:
    """A subclass of vLLM's KVCacheManager that keeps its copies pending one step more."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.targets.vllm.request import VllmManagerFactory, fine_grained_scope

    class LateCopies(KVCacheManager):
        held = False

        def take_kv_cache_block_copies(self) -> Any:
            copies, retained = super().take_kv_cache_block_copies()
            if copies and not self.held:
                # BUG: put them back, to hand over next time
                self.held = True
                pairs = [(retained[2 * i], retained[2 * i + 1]) for i in range(len(copies))]
                for manager in self.coordinator.single_type_managers:
                    manager._pending_cow_copies.extend(pairs)
                    break
                return [], []
            self.held = False
            return copies, retained

    report = run_request_conformance(
        fine_grained_scope(VllmManagerFactory(LateCopies)),
        hypothesis_profile="ci",
        max_examples=500,
        shrink=False,
    )
    assert not report.conforms
    assert "take_kv_cache_block_copies" in str(report.failure)


def _vllm_subclass_is_found(cls: type, evidence: str) -> None:
    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.targets.vllm.request import VllmManagerFactory, scope

    # 1000: since EAGLE and the look-ahead are drawn on every layout, the ci sample first
    # admits a sequence that cannot fit whole at program 818 (at 300 before)
    report = run_request_conformance(
        scope(VllmManagerFactory(cls)), hypothesis_profile="ci", max_examples=1000, shrink=False
    )
    assert not report.conforms
    assert evidence in str(report.failure) + str(report.program), report.failure


def test_a_vllm_manager_admitting_past_the_full_sequence_gate_is_found() -> None:
    """A subclass that drops ``full_sequence_must_fit``: it admits what cannot fit whole."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    class NoGate(KVCacheManager):
        def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
            kwargs.pop("full_sequence_must_fit", None)  # BUG
            return super().allocate_slots(*args, **kwargs)

    _vllm_subclass_is_found(NoGate, "full_sequence_must_fit")


def test_a_vllm_manager_freeing_the_blocks_it_pops_is_found() -> None:
    """A subclass whose ``pop_blocks_for_free`` already frees what it hands back: a block
    a step may still write goes back to the free queue."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    class EagerPop(KVCacheManager):
        def pop_blocks_for_free(self, request: Any) -> Any:
            blocks = super().pop_blocks_for_free(request)
            self.block_pool.free_blocks(reversed(blocks))  # BUG
            return blocks

    _vllm_subclass_is_found(EagerPop, "pop_blocks_for_free")


def test_kvpool_check_compares_vllm_033_in_every_part() -> None:
    """``kvpool check --layer request --target vllm`` runs the main scope and then what vLLM
    0.33 added (``PARTS_033_HISPARSE``: fine-grained hits, Mamba "align", hits inside a Mamba
    block, HiSparse)."""
    from kvpool.specs.request.target import PARTS_033_HISPARSE
    from kvpool.specs.targets import resolve
    from kvpool.specs.targets.vllm.releases import installed_version

    descriptor = resolve("request", "vllm")
    version = installed_version() or ""
    assert descriptor.parts == (PARTS_033_HISPARSE if version.startswith("0.33") else ())
