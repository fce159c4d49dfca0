"""kvpool against SGLang 0.5.23's radix caches: the three cores conform, the findings hold.

Every test here needs SGLang (``require_sglang``); those that run the legacy
or the Python core with events on also need its C++ page-hash extension.
"""

import os
import random
from collections.abc import Callable

import pytest

from kvpool.model import BlockStored
from kvpool.model import radix as model
from kvpool.model.radix import RadixConfig
from kvpool.model.radix_errors import NotLocked
from kvpool.specs.radix.check import check_radix
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.targets import resolve
from kvpool.specs.targets.sglang.findings import KNOWN_FINDINGS, for_core, skip_for
from kvpool.specs.targets.sglang.radix import SglangRadixFactory, SglangRadixTarget

pytestmark = pytest.mark.usefixtures("require_sglang")
CORES = ("rust", "python", "legacy")


def _explain(report: ConformanceReport) -> str:
    return f"{report.failure}\n{report.program}"


@pytest.mark.parametrize("core", CORES)
def test_each_core_conforms_at_level_1(core: str, require_native_hash: None) -> None:
    report = check_radix(SglangRadixFactory(core), "lru", 1, hypothesis_profile="ci")
    assert report.conforms, _explain(report)
    assert report.examples_run >= 100


@pytest.mark.parametrize("core", CORES)
def test_each_core_conforms_at_level_2_past_its_known_findings(
    core: str, require_native_hash: None
) -> None:
    skip = skip_for(for_core(core))
    report = check_radix(SglangRadixFactory(core), "lru", 2, hypothesis_profile="ci", skip=skip)
    assert report.conforms, _explain(report)


def test_a_level_2_divergence_of_the_rust_core_is_a_known_finding() -> None:
    report = check_radix(
        SglangRadixFactory("rust"), "lru", 2, hypothesis_profile="ci", shrink=False
    )
    assert not report.conforms and report.failure_kind == "divergence"
    findings = [f for f in for_core("rust") if f"{f.operation}(" in (report.failure or "")]
    assert any(f.model_error in (report.failure or "") for f in findings), report.failure


def test_a_split_that_announces_a_removal_shrinks_to_a_few_calls(
    require_native_hash: None,
) -> None:
    """sgl-project/sglang#14934 planted into 0.5.23's RadixCache: a short program shows it."""
    from tests.sglang.bugs import SplitRemovesRadixCache

    factory = SglangRadixFactory("legacy", SplitRemovesRadixCache)
    report = check_radix(factory, "lru", 1, events=(True,), hypothesis_profile="ci")
    assert not report.conforms and report.failure_kind == "divergence"
    # The operations the target received, as numbered steps ("step N: op(...) -> ...").
    lines = (report.program or "").splitlines()
    calls = [line.partition(": ")[2] for line in lines if line.startswith("step ")]
    assert 2 <= len(calls) <= 5, report.program
    assert any(c.startswith("match_prefix(") for c in calls), report.program
    assert calls[-1].startswith("take_events()"), report.program


def test_the_sglang_target_string_builds_what_the_server_builds() -> None:
    descriptor = resolve("radix", "sglang")
    assert descriptor.factory is not None
    target = descriptor.factory(RadixConfig())
    assert isinstance(target, SglangRadixTarget)
    chosen = os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust")
    assert target.core == chosen  # the variable's default is rust


# --------------------------------------------------------------------------
# The findings, one short program each
# --------------------------------------------------------------------------


def _cached(core: str) -> SglangRadixTarget:
    target = SglangRadixTarget(RadixConfig(enable_events=False), core)
    target.insert([1, 2, 3], [10, 11, 12], 0, 0, 0)
    target.match_prefix([1, 2, 3])
    return target


def _gone(core: str) -> SglangRadixTarget:
    target = _cached(core)
    target.evict(3)
    return target


PROGRAMS: dict[str, Callable[[str], object]] = {
    "unlock-not-locked": lambda core: _cached(core).unlock((1, 2, 3)),
    "lock-gone-node": lambda core: _gone(core).lock((1, 2, 3)),
    "unlock-gone-node": lambda core: _gone(core).unlock((1, 2, 3)),
    "too-few-slots": lambda core: _cached(core).insert([4, 5, 6], [1, 2], 0, 0, 0),
    "negative-prev-prefix-len": lambda core: _cached(core).insert([1, 2, 3], [7, 8, 9], -1, 0, 0),
    "evict-negative": lambda core: _cached(core).evict(-1),
}


@pytest.mark.parametrize("key", sorted(KNOWN_FINDINGS))
@pytest.mark.parametrize("core", CORES)
def test_each_finding_holds_for_exactly_its_cores(key: str, core: str) -> None:
    finding = KNOWN_FINDINGS[key]
    if core in finding.cores:
        PROGRAMS[key](core)  # accepted: no exception
    else:
        with pytest.raises(Exception) as refused:
            PROGRAMS[key](core)
        assert type(refused.value).__name__ == finding.model_error


def test_the_rust_core_refuses_every_call_after_a_panic() -> None:
    """The finding behind the adapter's rebuild: a refused unlock poisons the Rust core."""
    target = _cached("rust")
    cache = target.cache
    with pytest.raises(NotLocked):
        target.unlock((1, 2, 3))
    assert target.rebuilds == 1
    with pytest.raises(RuntimeError, match="poisoned"):
        cache.evictable_size()  # the old instance: every call is refused
    assert target.evictable_size() == 3  # the rebuilt one has the same state
    assert target.snapshot() == (((1, 2, 3), (10, 11, 12)),)


def test_legacy_fifo_ages_a_split_node_like_a_new_one() -> None:
    """RadixCache gives the upper part of a split a fresh creation time; unified cores copy it."""
    freed = {}
    for core in CORES:
        target = SglangRadixTarget(RadixConfig(1, "fifo", False), core)
        target.insert([1, 2, 3, 4], [10, 11, 12, 13], 0, 0, 0)
        target.insert([5], [20], 0, 0, 0)
        target.match_prefix([1, 2])
        freed[core] = target.evict(3).freed
    state = model.new_radix_cache(1, "fifo", False)
    state, _ = model.insert(state, [1, 2, 3, 4], [10, 11, 12, 13])
    state, _ = model.insert(state, [5], [20])
    state, _ = model.match_prefix(state, [1, 2])
    expected = model.evict(state, 3)[1].freed
    assert freed["rust"] == freed["python"] == expected == ((12, 13), (10, 11))
    assert freed["legacy"] == ((12, 13), (20,))


# --------------------------------------------------------------------------
# Events and snapshots
# --------------------------------------------------------------------------


def test_the_rust_core_s_page_hashes_are_the_model_s() -> None:
    target = SglangRadixTarget(RadixConfig(page_size=2), "rust")
    target.take_events()
    target.insert([1, 2, 3, 4, 5, 6], list(range(6)), 0, 0, 0)
    (stored,) = target.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == model.page_hashes((1, 2, 3, 4, 5, 6), 2)


def test_the_rust_snapshot_by_probes_equals_the_python_core_s_walk() -> None:
    rng = random.Random(7)
    rust = SglangRadixTarget(RadixConfig(enable_events=False), "rust")
    python = SglangRadixTarget(RadixConfig(enable_events=False), "python")
    slot = 0
    for _ in range(60):
        tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.5:
            slots = list(range(slot, slot + len(tokens)))
            slot += len(tokens)
            for target in (rust, python):
                target.insert(tokens, slots, 0, 0, 0)
        elif rng.random() < 0.7:
            for target in (rust, python):
                target.match_prefix(tokens)
        else:
            for target in (rust, python):
                target.evict(len(tokens))
        assert rust.snapshot() == python.snapshot()
