"""``run_conformance``: the one entry point for checking a Python block pool."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hypothesis import settings as Settings
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from kvpool.model import DEFAULT_PROFILE, PROFILES, Profile
from kvpool.specs import settings as _profiles  # noqa: F401  (registers the profiles)
from kvpool.specs.adapters.cmd_target import TargetAbort
from kvpool.specs.invariants import InvariantViolation
from kvpool.specs.machine import Divergence, PoolMachine, pool_machine
from kvpool.specs.regression import Counterexample, Recorder, explain
from kvpool.specs.target import TargetError, TargetFactory
from kvpool.specs.watchdog import DEFAULT_PROGRAM_TIMEOUT, Deadlines, program_deadlines


@dataclass
class ConformanceReport:
    """What one conformance run found."""

    target: str
    level: int
    profiles: tuple[str, ...]
    hypothesis_profile: str
    examples_run: int = 0
    seconds: float = 0.0
    conforms: bool = True
    failure_kind: str | None = None
    """``divergence``, ``invariant`` or ``target-error`` when it does not conform."""
    failure: str | None = None
    program: str | None = None
    """The minimal failing program, as Hypothesis printed it."""
    notes: list[str] = field(default_factory=list)
    counterexample: Counterexample | None = None
    """Where target and model part, side by side, and a regression test (divergences only)."""


def run_conformance(
    make_target: TargetFactory,
    level: int = 1,
    profile: str | Profile | Sequence[str | Profile] | None = None,
    *,
    hypothesis_profile: str = "ci",
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    target_name: str = "target",
    caching: Sequence[bool] = (True, False),
    events: Sequence[bool] = (False, True),
    on_example: Callable[[int], None] | None = None,
    program_timeout: float | None = DEFAULT_PROGRAM_TIMEOUT,
) -> ConformanceReport:
    """Check a block pool against the kvpool model and report whether it conforms.

    Paste this into your project and adapt the factory::

        from kvpool.model import PoolConfig
        from kvpool.specs.conformance import run_conformance

        def make_target(config: PoolConfig):
            # Return an object with the methods of kvpool.specs.target.PoolTarget,
            # speaking block ids, built for config.num_blocks, config.enable_caching,
            # config.hash_block_size, config.enable_events and config.profile.
            return MyPoolAdapter(config)

        report = run_conformance(make_target, level=1, profile="hashless-first")
        assert report.conforms, report.failure

    ``level`` 1 sends valid operations only; level 2 also sends invalid ones
    and requires the model's exception types with the state unchanged.
    ``profile`` names the semantics profile(s) the target claims (default:
    the seeds' ``hashless-first``). ``hypothesis_profile`` is ``ci``
    (derandomized), ``dev``, ``deep`` or ``fuzz``; ``max_examples``,
    ``steps`` and ``seed`` override it. Never raises for a divergence: the
    report says what failed and prints the shrunk program. A program running
    longer than ``program_timeout`` seconds ends the check with a target
    error (the target hangs); None removes the limit.
    """
    profiles = _resolve_profiles(profile)
    report = ConformanceReport(
        target=target_name,
        level=level,
        profiles=tuple(p.name for p in profiles),
        hypothesis_profile=hypothesis_profile,
    )
    preflight = getattr(make_target, "preflight", None)
    if preflight is not None:
        try:
            preflight(level, report.profiles)
        except TargetError as failure:
            _fail(report, "target-error", failure)
            return report
        except TargetAbort as abort:
            _fail(report, "target-error", abort.error)
            return report
    recorder = Recorder(make_target)
    machine = pool_machine(
        recorder,
        level=level,
        profiles=profiles,
        caching=caching,
        events=events,
        name="KVPoolConformance",
    )
    deadlines = Deadlines(None)
    counted = _counting(machine, report, on_example, lambda: deadlines.start_program())

    test = machine_test(counted, hypothesis_profile, max_examples, steps, seed)
    if seed is not None:
        report.notes.append(f"seed {seed}")

    printed: list[str] = []
    started = time.perf_counter()
    caught: BaseException | None = None
    try:
        with (
            with_reporter(lambda value: printed.append(str(value))),
            program_deadlines(program_timeout) as deadlines,
        ):
            test()
    except Divergence as failure:
        _fail(report, "divergence", caught := failure)
    except InvariantViolation as failure:
        _fail(report, "invariant", caught := failure)
    except TargetError as failure:
        _fail(report, "target-error", caught := failure)
    except TargetAbort as abort:
        # A broken program: stopped at once, so no minimal program to show.
        _fail(report, "target-error", abort.error)
    finally:
        report.seconds = time.perf_counter() - started
    if caught is not None:
        report.program = _program(printed, caught)
    if report.failure_kind in ("divergence", "invariant"):
        report.counterexample = explain(recorder, target_name, caught)
    return report


def machine_test(
    machine: type[RuleBasedStateMachine],
    hypothesis_profile: str,
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> Callable[[], None]:
    """The test that runs ``machine`` under a settings profile, with the runners' overrides."""
    # One failure per run: with several distinct bugs Hypothesis would raise an
    # ExceptionGroup, which the report cannot explain as one counterexample.
    overrides: dict[str, object] = {"report_multiple_bugs": False}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if steps is not None:
        overrides["stateful_step_count"] = steps
    chosen = Settings(Settings.get_profile(hypothesis_profile), **overrides)  # type: ignore[arg-type]
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


def _fail(report: ConformanceReport, kind: str, failure: BaseException) -> None:
    report.conforms = False
    report.failure_kind = kind
    report.failure = str(failure)


def _resolve_profiles(profile: str | Profile | Sequence[str | Profile] | None) -> list[Profile]:
    if profile is None:
        return [DEFAULT_PROFILE]
    if isinstance(profile, str | Profile):
        profile = [profile]
    chosen = []
    for p in profile:
        if isinstance(p, Profile):
            chosen.append(p)
        elif p in PROFILES:
            chosen.append(PROFILES[p])
        else:
            raise ValueError(f"unknown profile {p!r}; known: {', '.join(PROFILES)}")
    return chosen


def _counting(
    machine: type[PoolMachine],
    report: ConformanceReport,
    on_example: Callable[[int], None] | None,
    on_start: Callable[[], None] = lambda: None,
) -> type[PoolMachine]:
    """A subclass that counts the programs run (one machine instance per program)."""

    class Counted(machine):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            on_start()
            super().__init__()
            report.examples_run += 1
            if on_example is not None:
                on_example(report.examples_run)

    Counted.__name__ = Counted.__qualname__ = machine.__name__
    return Counted
