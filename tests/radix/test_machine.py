"""The radix lock-step machine: the model conforms to itself, planted bugs are found.

Planted-bug runs stop at the first failing program (``shrink=False``): the
point is that the machine finds the bug, not how short the program gets.
"""

import pytest

from kvpool.model.radix import POLICIES
from kvpool.specs import check
from kvpool.specs.radix.check import check_radix
from kvpool.specs.radix.machine import radix_machine
from kvpool.specs.radix.model_target import ModelRadixTarget
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.targets import TargetSpecError
from tests.radix import planted


def _explain(report: ConformanceReport) -> str:
    return f"{report.failure}\n{report.program}"


@pytest.mark.parametrize("level", [1, 2])
def test_the_model_conforms_to_itself(level: int) -> None:
    report = check_radix(ModelRadixTarget, "lru", level)
    assert report.conforms, _explain(report)
    assert report.examples_run >= 100


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "lru"])
def test_the_model_conforms_under_every_policy(policy: str) -> None:
    report = check_radix(ModelRadixTarget, policy, 2, max_examples=30)
    assert report.conforms, _explain(report)
    assert report.profiles == (policy,)


@pytest.mark.parametrize(
    ("bug", "evidence", "kind"),
    [
        (planted.SplitAnnouncesRemoval, "take_events()", "divergence"),
        (planted.EvictsLockedLeaves, "lock(", "divergence"),
        (planted.ServesTheCallersSlots, "insert(", "divergence"),
        (planted.ForgetsPendingEventsOnReset, "reset()", "divergence"),
        (planted.UnlockReleasesTheNodeOnly, "unlock(", "divergence"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_planted_bug_is_found(bug: type, evidence: str, kind: str) -> None:
    report = check_radix(bug, "lru", 1, shrink=False)
    assert not report.conforms
    assert report.failure_kind == kind, report.failure
    assert report.program and report.program.startswith("new_radix_cache(")
    assert evidence in report.program


def test_the_front_door_checks_the_radix_layer() -> None:
    report = check("radix", "model", max_examples=10, profiles=["lfu"])
    assert report.conforms and report.profiles == ("lfu",)


def test_the_front_door_refuses_two_policies_or_an_unknown_one() -> None:
    with pytest.raises(TargetSpecError, match="eviction policy"):
        check("radix", "model", profiles=["lru", "lfu"])
    with pytest.raises(TargetSpecError, match="eviction policy"):
        check("radix", "model", profiles=["hashless-first"])


def test_an_unknown_policy_is_refused_by_the_machine() -> None:
    with pytest.raises(ValueError, match="eviction policy"):
        radix_machine(ModelRadixTarget, "tlru")


def test_a_skipped_finding_is_not_sent_at_level_2() -> None:
    class AcceptsNegativeEvict(ModelRadixTarget):
        def evict(self, num_tokens: int):  # type: ignore[no-untyped-def]
            return super().evict(max(num_tokens, 0))

    found = check_radix(AcceptsNegativeEvict, "lru", 2, shrink=False)
    assert not found.conforms and "evict(-" in (found.program or "")
    skipped = check_radix(
        AcceptsNegativeEvict, "lru", 2, skip={("evict", "InvalidTokenCount")}, max_examples=40
    )
    assert skipped.conforms, _explain(skipped)
