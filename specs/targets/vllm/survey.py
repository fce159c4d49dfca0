"""Surveying vLLM's level-2 divergences: run level 2 again and again, stepping over each one."""

from typing import Any

from kvpool.specs.pool.check import run_conformance
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.targets.vllm.findings import (
    REQUEST_FINDINGS,
    Level2Divergence,
    classify_divergence,
)
from kvpool.specs.targets.vllm.pool import VllmTargetFactory
from kvpool.specs.targets.vllm.request import VllmManagerFactory, scope


def survey_level2(
    factory: VllmTargetFactory, rounds: int = 30, step_over_new: bool = False, **run_options: Any
) -> tuple[list[Level2Divergence], Any]:
    """Run level 2 again and again, stepping over each known finding once it is found.

    Returns the divergences in the order found and the last run's
    ``ConformanceReport``: it conforms when every divergence left is a known
    finding; otherwise its failure is the first divergence that is not (a
    new finding, or a wrong result, state or event, which no suppression
    can step over). With ``step_over_new`` a new rejection mismatch is stepped
    over too, to list every one. ``run_options`` go to ``run_conformance``.
    """
    found: list[Level2Divergence] = []
    suppressed: list[str] = list(factory.suppress)
    report: Any = None
    for _ in range(rounds):
        current = VllmTargetFactory(factory.pool_class(), suppressed, factory.workarounds)
        report = run_conformance(current, level=2, **run_options)
        if report.conforms:
            break
        divergence = classify_divergence(report.failure)
        if divergence is None:
            break
        found.append(divergence)
        if divergence.finding is not None:
            key = divergence.finding.key
        elif step_over_new:
            key = f"{divergence.operation}:{divergence.model_error}"
        else:
            break
        if key in suppressed:
            break
        suppressed.append(key)
    return found, report


def survey_request_level2(
    factory: VllmManagerFactory, rounds: int = 30, step_over_new: bool = False, **run_options: Any
) -> tuple[list[Level2Divergence], Any]:
    """``survey_level2`` at the request layer: vLLM's ``KVCacheManager`` at level 2 over
    ``VLLM_SCOPE``, each divergence stepped over (``SteppingOver``) once found.

    Known findings are ``REQUEST_FINDINGS``; returns the divergences in the
    order found and the last run's ``ConformanceReport``.
    """
    found: list[Level2Divergence] = []
    suppressed: list[tuple[str, str]] = list(factory.suppress)
    report: Any = None
    for _ in range(rounds):
        current = VllmManagerFactory(factory.manager_class(), factory.hash_mode, suppressed)
        report = run_request_conformance(scope(current), level=2, **run_options)
        if report.conforms:
            break
        divergence = classify_divergence(report.failure, REQUEST_FINDINGS)
        if divergence is None:
            break
        found.append(divergence)
        if divergence.finding is None and not step_over_new:
            break
        key = (divergence.operation, divergence.model_error)
        if key in suppressed:
            break
        suppressed.append(key)
    return found, report
