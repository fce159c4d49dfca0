"""The lock-step machine: the impl conforms, and planted bugs are found and shrunk."""

import pytest

from kvpool.model import PROFILES
from kvpool.specs.conformance import run_conformance
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.targets.impl.pool import ImplTarget
from tests.specs.planted_bugs import (
    AppendsHashlessBlocks,
    KeepsStaleHashOnReuse,
    RemovesEveryCopy,
    target_of,
)

MAX_PROGRAM_LINES = 12


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_impl_conforms_in_lock_step_with_the_model(level: int, profile: str) -> None:
    report = run_conformance(ImplTarget, level=level, profile=profile, hypothesis_profile="ci")
    assert report.conforms, f"{report.program}\n{report.failure}"
    assert report.examples_run >= 100


def test_model_conforms_to_itself_at_level_2() -> None:
    report = run_conformance(ModelTarget, level=2, profile=sorted(PROFILES), max_examples=50)
    assert report.conforms, report.failure


@pytest.mark.parametrize(
    ("bug", "evidence"),
    [
        (AppendsHashlessBlocks, "free queue"),
        (KeepsStaleHashOnReuse, ("get_new_blocks", "prefill")),
    ],
    ids=["hashless-appended", "stale-hash-on-reuse"],
)
def test_planted_bug_is_found_and_shrunk_to_a_short_program(
    bug: type, evidence: str | tuple[str, ...]
) -> None:
    report = run_conformance(target_of(bug), level=1, hypothesis_profile="ci")
    assert not report.conforms
    assert report.failure_kind in {"divergence", "invariant"}
    assert report.program is not None
    assert report.failure is not None
    steps = [line for line in report.program.splitlines() if line.startswith("step ")]
    assert 1 <= len(steps) <= MAX_PROGRAM_LINES, report.program
    assert any(
        e in report.failure + report.program
        for e in (evidence if isinstance(evidence, tuple) else (evidence,))
    ), report.program


@pytest.mark.parametrize("profile", ["hashless-first+last-copy", "append+last-copy"])
def test_impl_conforms_under_the_last_copy_event_semantics(profile: str) -> None:
    report = run_conformance(ImplTarget, level=2, profile=profile, hypothesis_profile="ci")
    assert report.conforms, f"{report.program}\n{report.failure}"


def test_a_pool_ignoring_the_last_copy_semantics_is_found() -> None:
    report = run_conformance(
        target_of(RemovesEveryCopy), level=1, profile="hashless-first+last-copy"
    )
    assert not report.conforms
    assert "event_stream_consistency" in (report.failure or "") or "BlockRemoved" in (
        report.failure or ""
    ), report.failure
