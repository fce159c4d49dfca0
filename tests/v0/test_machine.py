"""The v0 lock-step machine: conforming targets pass, planted bugs are found, vLLM 0.10.2 conforms.

Planted-bug runs stop at the first failing program (``shrink=False``): the
point is that the machine finds the bug; shrinking it costs about a minute
(``python bench/v0_vllm_check.py --planted`` shows the shrunk programs).
"""

import pytest

from kvpool.specs import ConformanceReport as V0Report
from kvpool.specs.v0.check import check_v0
from kvpool.specs.v0.machine import DISCIPLINES, v0_machine
from kvpool.specs.v0.model_target import ModelV0Target
from tests.v0.helpers import vllm_or_skip
from tests.v0.tiny_allocator import EvictsShortestPrefixFirst, NoDeduplication, TinyV0Allocator


def _explain(report: V0Report) -> str:
    return f"{report.failure}\n{report.program}"


@pytest.mark.parametrize("discipline", DISCIPLINES)
def test_the_model_conforms_to_itself(discipline: str) -> None:
    report = check_v0(ModelV0Target, discipline, max_examples=60)
    assert report.conforms, _explain(report)


@pytest.mark.parametrize("discipline", DISCIPLINES)
def test_an_independent_tiny_allocator_conforms(discipline: str) -> None:
    report = check_v0(TinyV0Allocator, discipline)
    assert report.conforms, _explain(report)
    assert report.examples_run >= 100


@pytest.mark.parametrize(
    ("bug", "evidence"),
    [(NoDeduplication, "append_token_ids"), (EvictsShortestPrefixFirst, "free(")],
    ids=["no-deduplication", "evictor-tie-break"],
)
def test_a_planted_bug_is_found(bug: type, evidence: str) -> None:
    report = check_v0(bug, "any", shrink=False)
    assert not report.conforms
    assert report.failure_kind in {"divergence", "invariant"}
    assert report.program and report.program.startswith("new_allocator(")
    assert evidence in report.program


def test_an_unknown_discipline_is_refused() -> None:
    with pytest.raises(ValueError, match="discipline"):
        v0_machine(ModelV0Target, "lenient")


# --------------------------------------------------------------------------
# vLLM's own v0 allocator (0.10.2)
# --------------------------------------------------------------------------


def test_vllm_v0_conforms_under_the_engine_discipline() -> None:
    vllm_or_skip()
    from kvpool.specs.targets.vllm.v0 import make_vllm_v0_target

    report = check_v0(make_vllm_v0_target, "engine", target_name="vllm-0.10.2")
    assert report.conforms, _explain(report)
    assert report.examples_run >= 100


def test_planted_bugs_in_vllms_allocator_are_found() -> None:
    """The machine finds the same two mistakes planted into vLLM's own classes."""
    vllm_or_skip()
    from tests.v0.vllm_planted import deduplication_bug, tie_break_bug

    for make_target in (deduplication_bug, tie_break_bug):
        report = check_v0(make_target, "engine", shrink=False)
        assert not report.conforms, make_target.__name__


def test_vllm_v0_diverges_under_the_any_discipline() -> None:
    """Its evictor bugs (docs/semantics.md, "The v0 allocator") are found without being told."""
    vllm_or_skip()
    from kvpool.specs.targets.vllm.v0 import make_vllm_v0_target

    report = check_v0(make_vllm_v0_target, "any", shrink=False)
    assert not report.conforms
    assert report.failure is not None and "mark_blocks_as_accessed" in (report.program or "")
