"""An in-process target that loops forever is reported as hung, not waited for."""

import time
from typing import Any

from kvpool.impl import BlockPool
from kvpool.specs.conformance import run_conformance
from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
from kvpool.specs.request.target import ManagerTargetSpec
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT, program_deadlines
from kvpool.specs.targets.impl.request import ImplManagerTarget
from tests.corpus.bugs import target_of


class LoopsOnFree(BlockPool):
    def free_blocks(self, ordered_blocks: Any) -> None:
        while True:
            pass


class LoopingManagerTarget(ImplManagerTarget):
    def free(self, request: Any) -> None:
        while True:
            pass


def test_a_pool_that_loops_is_a_target_error_within_the_limit() -> None:
    started = time.perf_counter()
    report = run_conformance(target_of(LoopsOnFree), hypothesis_profile="ci", program_timeout=1)
    assert time.perf_counter() - started < 30
    assert report.failure_kind == "target-error"
    assert "hangs or loops" in (report.failure or "")


def test_a_manager_that_loops_is_a_target_error_within_the_limit() -> None:
    started = time.perf_counter()
    report = run_manager_conformance(
        ManagerTargetSpec(LoopingManagerTarget), hypothesis_profile="ci", program_timeout=1
    )
    assert time.perf_counter() - started < 30
    assert report.failure_kind == "target-error"
    assert "hangs or loops" in (report.failure or "")


def test_the_limit_is_lifted_afterwards_and_the_default_is_generous() -> None:
    import signal

    before = signal.getsignal(signal.SIGALRM)
    with program_deadlines(5) as deadlines:
        deadlines.start_program()
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    assert signal.getsignal(signal.SIGALRM) == before
    assert DEFAULT_PROGRAM_TIMEOUT >= 30
