"""The one runner: a layer's state machine under Hypothesis, turned into a ``ConformanceReport``.

Every layer's ``check`` builds its machine class and calls ``run_machine``,
which counts the programs, gives each a time limit (``watchdog``), runs the
machine under a Hypothesis settings profile (``settings``), and sorts the
way the run ended: a ``Divergence`` or an ``InvariantViolation`` means the
target does not conform; a ``TargetError`` (or the ``TargetAbort`` carrying
one) means it could not be checked. Layers pass in what is theirs: how to
explain a divergence, and whether the failing program is the one Hypothesis
printed or the calls the machine traced.
"""

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypedDict, Unpack

from hypothesis import settings as Settings
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from kvpool.specs.errors import Divergence, InvariantViolation, TargetAbort, TargetError
from kvpool.specs.runner import settings as _profiles  # noqa: F401  (registers the profiles)
from kvpool.specs.runner.report import ConformanceReport, Counterexample
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT, Deadlines, program_deadlines


class RunOptions(TypedDict, total=False):
    """The options every layer's check takes, whatever the layer (all optional).

    ``hypothesis_profile`` (default ``ci``) is a profile of
    ``kvpool.specs.runner.settings``; ``max_examples``, ``steps`` and ``seed``
    override it. ``target_name`` names the target in the report (default
    ``target``). ``on_example`` is called with the number of programs run so
    far. A program running longer than ``program_timeout`` seconds (default
    60) ends the check with a target error: the target hangs; None removes the
    limit.
    """

    hypothesis_profile: str
    max_examples: int | None
    steps: int | None
    seed: int | None
    target_name: str
    on_example: Callable[[int], None] | None
    program_timeout: float | None


FAILURES = (Divergence, InvariantViolation, TargetError, TargetAbort)
"""What ends a program as a failure of the target (anything else is Hypothesis's or the kit's)."""

Explain = Callable[[BaseException], Counterexample | None]
"""Builds the counterexample of a failed run from the failure (divergences and invariants)."""


class LastProgram:
    """The machine instance of the latest program (after a failure: the minimal one)."""

    machine: RuleBasedStateMachine | None = None


def run_machine(
    machine: type[RuleBasedStateMachine],
    *,
    level: int,
    profiles: Sequence[str],
    preflight: Callable[[], None] | None = None,
    explain: Explain | None = None,
    traced_program: bool = False,
    overrides: Mapping[str, object] | None = None,
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Run ``machine`` and report how it went; never raises for a failure of the target.

    ``level`` and ``profiles`` (what the target is checked at) go into the
    report. ``preflight`` runs first and may raise ``TargetError`` (the target cannot
    be checked here). ``traced_program`` reports the failing program as the
    calls the machine traced (``LockStep.trace``) instead of the program
    Hypothesis printed. ``overrides`` are further Hypothesis settings.
    """
    hypothesis_profile = options.get("hypothesis_profile", "ci")
    seed = options.get("seed")
    on_example = options.get("on_example")
    report = ConformanceReport(
        target=options.get("target_name", "target"),
        level=level,
        profiles=tuple(profiles),
        hypothesis_profile=hypothesis_profile,
    )
    if preflight is not None:
        try:
            preflight()
        except TargetError as failure:
            report.fail("target-error", failure)
            return report
        except TargetAbort as abort:
            report.fail("target-error", abort.error)
            return report
    last = LastProgram()
    deadlines = Deadlines(None)
    started = time.perf_counter()
    counted = _counting(
        machine, report, on_example, lambda: deadlines.start_program(), last, started
    )
    test = machine_test(
        counted,
        hypothesis_profile,
        options.get("max_examples"),
        options.get("steps"),
        seed,
        overrides,
    )
    if seed is not None:
        report.notes.append(f"seed {seed}")

    printed: list[str] = []
    caught: BaseException | None = None
    try:
        with (
            with_reporter(lambda value: printed.append(str(value))),
            program_deadlines(options.get("program_timeout", DEFAULT_PROGRAM_TIMEOUT)) as deadlines,
            only_global_constants(),
        ):
            test()
    except Divergence as failure:
        report.fail("divergence", caught := failure)
    except InvariantViolation as failure:
        report.fail("invariant", caught := failure)
    except TargetError as failure:
        report.fail("target-error", caught := failure)
    except TargetAbort as abort:
        # A broken program: stopped at once, so no minimal program to show.
        report.fail("target-error", abort.error)
    finally:
        report.seconds = time.perf_counter() - started
        if report.seconds_to_first_failure is not None:
            report.shrink_seconds = report.seconds - report.seconds_to_first_failure
    if caught is not None:
        trace = getattr(last.machine, "trace_lines", None)
        if traced_program and trace is not None:
            report.program = "\n".join(trace()) or None
        else:
            report.program = _program(printed, caught)
    if explain is not None and report.failure_kind in ("divergence", "invariant"):
        assert caught is not None
        report.counterexample = explain(caught)
    return report


@contextmanager
def only_global_constants() -> Iterator[None]:
    """Within the block, Hypothesis draws no constants from the code on ``sys.path``.

    Hypothesis now and then draws a literal found in "local" modules (any code
    outside site-packages). That made the derandomized ``ci`` programs depend
    on every literal in kvpool (an editable install counts as local, a wheel
    does not) and in the user's own modules: the same seed gave different runs,
    and an edit anywhere reshuffled which bugs ``ci`` found. Its own constants
    (boundaries such as 0, -1, 2**63) are kept. The hook is private; without it
    this does nothing.
    """
    hook = getattr(providers, "_get_local_constants", None)
    if hook is None:  # pragma: no cover  (a Hypothesis without local constants)
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = hook
        providers.CONSTANTS_CACHE.cache.clear()


def machine_test(
    machine: type[RuleBasedStateMachine],
    hypothesis_profile: str,
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Callable[[], None]:
    """The test that runs ``machine`` under a settings profile, with the runner's overrides."""
    # One failure per run: with several distinct bugs Hypothesis would raise an
    # ExceptionGroup, which the report cannot explain as one counterexample.
    chosen_overrides: dict[str, object] = {"report_multiple_bugs": False, **(overrides or {})}
    if max_examples is not None:
        chosen_overrides["max_examples"] = max_examples
    if steps is not None:
        chosen_overrides["stateful_step_count"] = steps
    profile = Settings.get_profile(hypothesis_profile)
    chosen = Settings(profile, **chosen_overrides)  # type: ignore[arg-type]
    test: Callable[[], None] = get_state_machine_test(machine, settings=chosen)
    if seed is not None:
        # hypothesis.seed() only decorates functions; this is the attribute it sets.
        test._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
    return test


def _program(printed: list[str], failure: BaseException | None) -> str | None:
    """The minimal program: printed by Hypothesis, or attached to the failure as notes."""
    lines = [line for line in printed if line.strip()]
    notes = [str(n) for n in getattr(failure, "__notes__", ())]
    if not lines and notes:
        for note in notes:
            if note.startswith(("Explanation:", "\nYou can reproduce", "You can reproduce")):
                break
            lines.append(note)
    noise = ("state.target_agrees_with_model()", "Failing test case: <state machine>")
    program = [line for line in lines if line.strip() not in noise]
    return "\n".join(program) or None


def _counting(
    machine: type[RuleBasedStateMachine],
    report: ConformanceReport,
    on_example: Callable[[int], None] | None,
    on_start: Callable[[], None],
    last: LastProgram,
    started: float,
) -> type[RuleBasedStateMachine]:
    """A subclass that counts the programs run (one machine instance per program).

    It also notes when the first program fails: the time to detection, before
    Hypothesis shrinks that program (the report shows the two apart).
    """

    class Counted(machine):  # type: ignore[valid-type,misc]
        # No arguments, and the machine's own name below: Hypothesis derives the
        # derandomized (ci) programs from the class's name and signature.
        def __init__(self) -> None:
            on_start()
            super().__init__()
            last.machine = self
            report.examples_run += 1
            if on_example is not None:
                on_example(report.examples_run)

        def teardown(self) -> None:
            # Hypothesis calls teardown in a `finally`: a failing program's
            # exception is the one being propagated here.
            failed = isinstance(sys.exc_info()[1], FAILURES)
            if failed and report.seconds_to_first_failure is None:
                report.seconds_to_first_failure = time.perf_counter() - started
                report.programs_to_first_failure = report.examples_run
            super().teardown()

    Counted.__name__ = Counted.__qualname__ = machine.__name__
    return Counted
