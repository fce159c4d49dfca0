"""The event layer's acceptance criteria, each with the short stream the machine shrinks to.

* the reference consumer conforms under both event semantics;
* a consumer keeping a set instead of counts fails under multiset, passes under last-copy;
* a consumer ignoring AllBlocksCleared fails under both.
"""

import pytest

from kvpool.specs.events.check import _merge, check_events
from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.runner.report import ConformanceReport
from tests.events.consumers import IgnoresCleared, SetConsumer

MAX_BATCHES = 6
"""A shrunk failure is at most this many batches of events."""


def batches(program: str | None) -> list[str]:
    """The batches a failing program sent, from its numbered steps (``step N: apply_events(``)."""
    assert program is not None
    steps = [line.partition(": ")[2] for line in program.splitlines() if line.startswith("step ")]
    return [step for step in steps if step.startswith("apply_events(")]


def test_the_reference_consumer_conforms_under_both_semantics() -> None:
    report = check_events(ReferenceConsumer, target_name="model")
    assert report.conforms, report.failure
    assert report.verdicts == {"multiset": "conforms", "last-copy": "conforms"}
    assert report.claimed == ("multiset", "last-copy")
    assert report.examples_run >= 300


@pytest.fixture(scope="module")
def set_report() -> ConformanceReport:
    return check_events(SetConsumer, target_name="tests.events:set")


def test_a_consumer_keeping_a_set_fails_under_multiset_and_passes_under_last_copy(
    set_report: ConformanceReport,
) -> None:
    report = set_report
    assert report.verdicts == {"multiset": "diverges", "last-copy": "conforms"}
    assert not report.conforms
    assert report.failure_kind == "invariant"
    assert "no_missed_hits" in (report.failure or "")
    found = batches(report.program)
    assert 1 <= len(found) <= MAX_BATCHES, report.program
    # The minimal stream: one hash stored twice, removed once, still held.
    assert any("removed" in line for line in found), report.program


def test_only_claimed_semantics_decide_the_verdict() -> None:
    report = ConformanceReport("set", 1, ("multiset", "last-copy"), "ci", claimed=("last-copy",))
    failed = ConformanceReport("set", 1, ("multiset",), "ci", examples_run=7)
    failed.fail("invariant", AssertionError("invariant no_missed_hits violated"))
    failed.program = "apply_events(...)"
    _merge(report, failed, "multiset", claimed=False)
    passed = ConformanceReport("set", 1, ("last-copy",), "ci", examples_run=20)
    _merge(report, passed, "last-copy", claimed=True)
    assert report.conforms
    assert report.verdicts == {"multiset": "diverges", "last-copy": "conforms"}
    assert any("under multiset (not claimed): diverges" in note for note in report.notes)
    _merge(report, failed, "multiset", claimed=True)
    assert not report.conforms
    assert report.program == "apply_events(...)"


def test_a_semantics_under_which_nothing_ran_is_no_verdict() -> None:
    report = ConformanceReport("set", 1, ("multiset",), "ci", claimed=("multiset",))
    _merge(report, ConformanceReport("set", 1, ("multiset",), "ci"), "multiset", claimed=True)
    assert report.verdicts == {"multiset": "no verdict (nothing-ran)"}
    assert report.exit_code == 2 and report.failure_kind == "nothing-ran"


def test_a_consumer_that_claims_no_semantics_checked_gets_no_verdict() -> None:
    class ClaimsNothing(ReferenceConsumer):
        event_semantics = ()

    report = check_events(ClaimsNothing, max_examples=5, steps=10, target_name="t")
    assert report.claimed == ()
    assert report.verdicts == {"multiset": "conforms", "last-copy": "conforms"}
    assert report.exit_code == 2 and report.failure_kind == "nothing-ran"
    assert "claims none of the semantics checked" in (report.failure or "")


def test_a_consumer_ignoring_cleared_fails_under_both_semantics() -> None:
    report = check_events(IgnoresCleared, target_name="no-clear")
    assert report.verdicts == {"multiset": "diverges", "last-copy": "diverges"}
    assert "no_phantom_hits" in (report.failure or "")
    found = batches(report.program)
    assert 1 <= len(found) <= MAX_BATCHES, report.program
    assert any("cleared" in line for line in found), report.program


@pytest.mark.parametrize("semantics", ["multiset", "last-copy"])
def test_one_semantics_at_a_time(semantics: str) -> None:
    report = check_events(ReferenceConsumer, semantics=[semantics], max_examples=30)
    assert list(report.verdicts) == [semantics]
    assert report.claimed == (semantics,)


def test_a_failure_becomes_a_vector_and_a_regression_test(set_report: ConformanceReport) -> None:
    example = set_report.counterexample
    assert example is not None
    assert example.layer == "events"
    assert '"event_semantics":"multiset"' in example.vector
    assert '"known":{"tests.events:set":"mismatch"}' in example.vector
    assert "run_vector" in example.regression_test
    assert "holds" in example.model_side and "scored" in example.target_side
