"""The one runner: a layer's state machine under Hypothesis, turned into a ``ConformanceReport``.

Every layer's ``check`` builds its machine class and calls ``run_machine``,
which counts the programs, gives each a time limit (``watchdog``), runs the
machine under a Hypothesis settings profile (``settings``) with kvpool's own
example database for the layer and target (``database``), and sorts the way
the run ended into a failure kind (``report.FAILURE_KINDS``, whose exit codes
``ConformanceReport.exit_code`` gives): a ``Divergence`` or an
``InvariantViolation`` means the target does not conform; a ``TargetError``
(or the ``TargetAbort`` carrying one), a target's ``SystemExit``,
``KeyboardInterrupt`` or ``RecursionError``, or an exception raised outside
the kit's code mean it could not be checked; a ``Flaky`` run names the two
runs that disagreed; zero programs is no verdict. Only the user's Ctrl-C
leaves as an exception. Layers pass in what is theirs: how to explain a
divergence, and how the failing program reads (``LockStep.program_lines``:
the operations the target received, numbered as steps).
"""

import signal
import sys
import threading
import time
import traceback
import unittest
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict, Unpack, cast

from hypothesis import Phase
from hypothesis import settings as Settings
from hypothesis.errors import Flaky, HypothesisException, Unsatisfiable
from hypothesis.internal.conjecture import providers
from hypothesis.internal.constants_ast import Constants
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from kvpool.specs.errors import Divergence, InvariantViolation, TargetAbort, TargetError
from kvpool.specs.runner import database as databases
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
    limit. ``shrink=False`` reports the first failing program as it was found,
    without shrinking it to a minimal one: the verdict comes as soon as the
    failure does (the programs run are the same), the program shown is longer.
    """

    hypothesis_profile: str
    max_examples: int | None
    steps: int | None
    seed: int | None
    target_name: str
    on_example: Callable[[int], None] | None
    program_timeout: float | None
    shrink: bool


NOT_SHRUNK = "not shrunk: a failing program is shown as it was found"
"""The note of a run asked not to shrink (``shrink=False``)."""

FAILURES = (Divergence, InvariantViolation, TargetError, TargetAbort)
"""What ends a program as a failure of the target (anything else is Hypothesis's or the kit's)."""

Explain = Callable[[BaseException], Counterexample | None]
"""Builds the counterexample of a failed run from the failure (divergences and invariants)."""

MAX_LINES = 60
"""Lines of one program a report shows at most (the rest is counted)."""


class Programs:
    """What the runner keeps of the programs run: the latest, and the failing ones."""

    def __init__(self, started: float) -> None:
        self.started = started
        """When the run started (``time.perf_counter()``), for the time to detection."""
        self.machine: RuleBasedStateMachine | None = None
        """The machine of the latest program (after a failure: the minimal one)."""
        self.first_failure: tuple[int, list[str], BaseException] | None = None
        """The first program that failed: its number, its lines and what it raised."""
        self.detected: tuple[int, float] | None = None
        """The first program that failed as a target fails (``FAILURES``), and the seconds
        from the start of the run until it ended: the time to detection, before shrinking."""

    def ended(self, machine: RuleBasedStateMachine, number: int) -> None:
        """Called as each program ends (in Hypothesis's ``finally``, so an exception in
        flight is this program's failure); notes the first failures."""
        failure = sys.exception()
        if not isinstance(failure, Exception) or isinstance(failure, HypothesisException):
            return
        if self.first_failure is None:
            self.first_failure = (number, program_lines(machine), failure)
        if self.detected is None and isinstance(failure, FAILURES):
            self.detected = (number, time.perf_counter() - self.started)


def program_lines(machine: RuleBasedStateMachine | None) -> list[str]:
    """The program ``machine`` ran, one numbered step per line, if it can say (``LockStep``)."""
    lines = getattr(machine, "program_lines", None)
    if lines is None:
        return []
    try:
        found: list[str] = lines()
    except Exception as error:  # a target's value that cannot be shown
        return [f"(the program cannot be shown: {type(error).__name__}: {error})"]
    if len(found) > MAX_LINES:
        found = [*found[: MAX_LINES - 1], f"... and {len(found) - MAX_LINES + 1} more steps"]
    return found


def run_machine(
    machine: type[RuleBasedStateMachine],
    *,
    level: int,
    profiles: Sequence[str],
    layer: str | None = None,
    preflight: Callable[[], None] | None = None,
    explain: Explain | None = None,
    traced_program: bool = True,
    overrides: Mapping[str, object] | None = None,
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Run ``machine`` and report how it went; never raises for a failure of the target.

    ``level`` and ``profiles`` (what the target is checked at) go into the
    report; ``layer`` too (default: the package of the machine's module,
    ``kvpool.specs.pool.machine`` is ``pool``), which with the target's name
    keys the example database. ``preflight`` runs first and may raise
    ``TargetError`` (the target cannot be checked here). ``traced_program``
    reports the failing program as the operations the target received
    (``LockStep.program_lines``) instead of the program Hypothesis printed.
    ``overrides`` are further Hypothesis settings.

    Only a user's Ctrl-C (``KeyboardInterrupt`` from SIGINT) and
    ``databases.RedisUnavailable`` (Redis asked for, not usable) leave this
    function as exceptions; whatever else the target or the run raises ends
    in the report (``ConformanceReport.exit_code`` says what it means).
    """
    hypothesis_profile = options.get("hypothesis_profile", "ci")
    seed = options.get("seed")
    max_examples = options.get("max_examples")
    steps = options.get("steps")
    on_example = options.get("on_example")
    program_timeout = options.get("program_timeout", DEFAULT_PROGRAM_TIMEOUT)
    report = ConformanceReport(
        target=options.get("target_name", "target"),
        level=level,
        profiles=tuple(profiles),
        hypothesis_profile=hypothesis_profile,
        layer=layer or _layer_of(machine),
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
        except Exception as error:  # a user's preflight hook
            report.fail("target-error", _unexpected("the target's preflight", error))
            return report
    deadlines = Deadlines(None)
    started = time.perf_counter()
    programs = Programs(started)
    counted = _counting(machine, report, on_example, lambda: deadlines.start_program(), programs)
    database = _database(report, hypothesis_profile, seed)
    chosen_overrides = dict(overrides or {})
    if not options.get("shrink", True):
        phases = cast(
            "Sequence[Phase]",
            chosen_overrides.get("phases", Settings.get_profile(hypothesis_profile).phases),
        )
        chosen_overrides["phases"] = [phase for phase in phases if phase is not Phase.shrink]
        report.shrunk = False
        report.notes.append(NOT_SHRUNK)
    if database is not None or _profile_has_database(hypothesis_profile) or seed is not None:
        chosen_overrides["database"] = database
    test = machine_test(counted, hypothesis_profile, max_examples, steps, seed, chosen_overrides)
    report.max_examples = max_examples or Settings.get_profile(hypothesis_profile).max_examples
    report.steps_per_program = steps or Settings.get_profile(hypothesis_profile).stateful_step_count
    if seed is not None:
        report.notes.append(f"seed {seed}: no example database is read or written")

    printed: list[str] = []
    caught: BaseException | None = None
    with _user_interrupts() as interrupted:
        try:
            with (
                with_reporter(lambda value: printed.append(str(value))),
                program_deadlines(program_timeout) as deadlines,
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
        except Flaky as failure:
            report.fail("flaky", _flaky(report, programs, failure))
        except (Unsatisfiable, unittest.SkipTest) as failure:
            report.fail("nothing-ran", f"Hypothesis ran no program: {_first_line(failure)}")
        except KeyboardInterrupt as interrupt:
            if interrupted():
                raise
            caught = interrupt
            report.fail("target-error", _exited(report, "raised KeyboardInterrupt"))
        except SystemExit as exit:
            caught = exit
            report.fail("target-error", _exited(report, f"raised SystemExit({exit.code!r})"))
        except RecursionError as error:
            caught = error
            report.fail("target-error", _too_deep(report, error))
        except MemoryError:
            report.fail(
                "target-error",
                f"the check ran out of memory checking {report.target}: the target used "
                "or returned more than this machine holds",
            )
        except Exception as error:  # no traceback reaches a user: exit 2
            if _raised_by_kit(error):
                report.fail("kit-error", _unexpected(f"checking {report.target}", error))
            else:
                caught = error
                report.fail("target-error", _raised(report, error))
        finally:
            report.seconds = time.perf_counter() - started
            if programs.detected is not None:
                number, seconds = programs.detected
                report.programs_to_first_failure = number
                report.seconds_to_first_failure = seconds
                report.shrink_seconds = report.seconds - seconds
    if isinstance(database, databases.CountingDatabase) and programs.first_failure is not None:
        report.from_database = 0 < programs.first_failure[0] <= database.fetched
        if report.from_database and report.failure_kind in ("divergence", "invariant"):
            report.notes.append(
                "the failing program was replayed from the example database (saved by an "
                f"earlier run, in {databases.examples_home()}); --database none runs without it"
            )
    if caught is not None:
        # Traced: the operations the target received, or none (it failed before the first);
        # never Hypothesis's rule names, which are the kit's, not the user's.
        lines = program_lines(programs.machine) if traced_program else []
        report.program = "\n".join(lines) if traced_program else _program(printed, caught)
        report.program = report.program or None
    if report.conforms and report.examples_run == 0:
        report.fail("nothing-ran", "no program was run, so nothing was checked")
    if explain is not None and report.failure_kind in ("divergence", "invariant"):
        assert caught is not None
        try:
            report.counterexample = explain(caught)
        except Exception as error:  # the report stands without it
            report.notes.append(
                f"no regression test could be written: {type(error).__name__}: {error}"
            )
    return report


def _layer_of(machine: type[RuleBasedStateMachine]) -> str:
    """``pool`` for a machine defined in ``kvpool.specs.pool.machine``, and so on."""
    parts = machine.__module__.split(".")
    return parts[-2] if len(parts) >= 2 else machine.__module__


def _database(report: ConformanceReport, profile: str, seed: int | None) -> Any:
    """The run's example database (counting what it replays), or None."""
    if seed is not None or not _profile_has_database(profile):
        return None
    found = databases.database_for(report.layer, report.target, databases.chosen(), report.notes)
    return None if found is None else databases.CountingDatabase(found)


def _profile_has_database(profile: str) -> bool:
    return Settings.get_profile(profile).database is not None


@contextmanager
def _user_interrupts() -> Iterator[Callable[[], bool]]:
    """Within the block, tells a user's Ctrl-C from a KeyboardInterrupt a target raised."""
    pressed = [False]
    if threading.current_thread() is not threading.main_thread():
        yield lambda: True
        return

    def on_sigint(signum: int, frame: object) -> None:
        pressed[0] = True
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: pressed[0]
    finally:
        signal.signal(signal.SIGINT, previous)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _exited(report: ConformanceReport, what: str) -> str:
    return (
        f"{report.target} {what}: a target must answer or reject each call, never stop "
        "the process that checks it. No verdict: the programs before it are not evidence "
        "of conformance."
    )


def _too_deep(report: ConformanceReport, error: RecursionError) -> str:
    return (
        f"checking {report.target} hit Python's recursion limit (RecursionError)"
        f"{_where(error)}: the target "
        "recursed without end or gave an answer nested too deeply to compare. No verdict."
    )


KIT = Path(__file__).resolve().parents[1]
"""``kvpool/specs``: code here is the kit's; anything else the target's (or its engine's)."""


def _raised_by_kit(error: BaseException) -> bool:
    """Whether the innermost Python frame ``error`` was raised in is the kit's own code."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return True
    try:
        return Path(frames[-1].filename).resolve().is_relative_to(KIT)
    except (OSError, ValueError):
        return True


def _raised(report: ConformanceReport, error: BaseException) -> str:
    return (
        f"{report.target} raised {type(error).__name__}: {_first_line(error)}{_where(error)}, "
        "where it had to answer or reject the call with one of the model's exceptions. "
        "No verdict: the target could not be checked."
    )


def _unexpected(doing: str, error: BaseException) -> str:
    return (
        f"{doing} stopped on an unexpected {type(error).__name__}: {_first_line(error)}"
        f"{_where(error)}. If the target returned something unusual, the kit could not "
        "read it; otherwise this is a bug in kvpool (please report it). No verdict."
    )


def _flaky(report: ConformanceReport, programs: Programs, failure: Flaky) -> str:
    """The report of a flaky target: the run that failed, and the run of it that did not."""
    lines = [
        f"{report.target} is flaky: the same program gave different answers on two runs, so "
        "its answers depend on something besides the calls it received (state kept across "
        "programs, time, randomness, threads). No verdict: fix that first.",
    ]
    first = programs.first_failure
    if first is not None:
        number, steps, error = first
        lines.append(f"Run 1 (program {number}) failed: {_first_line(error)}")
        lines.extend(f"  {line}" for line in steps)
    else:
        lines.append(f"Run 1 failed: {_first_line(failure)}")
    again = program_lines(programs.machine)
    lines.append(
        f"Run 2 (program {report.examples_run}), the same choices replayed, "
        + ("went otherwise:" if again else "went otherwise.")
    )
    lines.extend(f"  {line}" for line in again)
    return "\n".join(lines)


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
    last: Programs,
) -> type[RuleBasedStateMachine]:
    """A subclass that counts the programs run (one machine instance per program).

    Each program's end goes to ``last`` (``Programs.ended``), which keeps the first
    failure and the time to detection, before Hypothesis shrinks it.
    """

    class Counted(machine):  # type: ignore[valid-type,misc]
        # No arguments, and the machine's own name below: Hypothesis derives the
        # derandomized (ci) programs from the class's name and signature.
        def __init__(self) -> None:
            on_start()
            super().__init__()
            last.machine = self
            report.examples_run += 1
            self.program_number = report.examples_run
            if on_example is not None:
                on_example(report.examples_run)

        def teardown(self) -> None:
            last.ended(self, self.program_number)
            super().teardown()

    Counted.__name__ = Counted.__qualname__ = machine.__name__
    return Counted
