"""vLLM 0.33's BlockPool in full: the machine calls every public method, and finds bugs in them."""

import inspect
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
        ("SourceStillReachablePool", "relocate"),
    ],
)
def test_a_planted_bug_in_a_033_operation_is_found(pool_class: str, evidence: str) -> None:
    report = run_conformance(
        VllmTargetFactory(f"tests.vllm.buggy_pools:{pool_class}"),
        level=1,
        hypothesis_profile="ci",
        max_examples=300,
    )
    assert not report.conforms
    assert report.failure_kind in {"divergence", "invariant"}, report.failure
    assert evidence in (report.failure or "") + (report.program or ""), report.failure
