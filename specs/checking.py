"""``check``: one front door to every layer's check, by layer and target string.

::

    from kvpool.specs import check

    report = check("pool", "impl", level=2)
    report = check("request", "mypackage.adapter:make_manager")
    assert report.conforms, report.failure

The target string is resolved by the registry (``kvpool.specs.targets``);
the descriptor's factory, claimed profiles, unsupported operations, preflight
and scope go to the layer's own check (``kvpool.specs.pool.check``,
``kvpool.specs.request.check``, ``kvpool.specs.v0.check``,
``kvpool.specs.events.check``, ``kvpool.specs.radix.check``). ``kvpool check``
and the pytest plugin both come through here.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Unpack

from kvpool.model import EVENT_SEMANTICS, InvalidConfig, PoolError
from kvpool.model.profiles import profile_named
from kvpool.model.radix import POLICIES
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.events.check import check_events
from kvpool.specs.pool.check import run_conformance
from kvpool.specs.radix.check import check_radix
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.target import ManagerTargetSpec
from kvpool.specs.runner.render import verdict as verdict_of
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import RunOptions
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT
from kvpool.specs.targets import TargetDescriptor, TargetSpecError, resolve
from kvpool.specs.v0.check import check_v0
from kvpool.specs.v0.machine import DISCIPLINES
from kvpool.specs.vectors.format import LoadedVector
from kvpool.specs.vectors.request_replay import RequestRunResult, run_request_corpus

LEVELS = {"pool": (1, 2), "request": (1, 2), "v0": (1,), "events": (1,), "radix": (1, 2)}
"""The levels each layer's machine has."""


def check(
    layer: str,
    target: str | TargetDescriptor,
    *,
    level: int = 1,
    profiles: Sequence[str] | None = None,
    hypothesis_profile: str = "ci",
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    target_name: str | None = None,
    on_example: Callable[[int], None] | None = None,
    program_timeout: float | None = DEFAULT_PROGRAM_TIMEOUT,
    shrink: bool = True,
) -> ConformanceReport:
    """Check ``target`` at ``layer`` and report whether it conforms; never raises for a target.

    ``profiles`` are the semantics profiles the target claims (pool and request
    layers; default: what the target declares, else the kit's default), at
    the v0 layer the disciplines (``any``, ``engine``), at the events layer
    the event semantics (``multiset``, ``last-copy``; default: run under both,
    the verdict counting those the target claims), at the radix layer the
    eviction policy (default ``lru``). ``shrink=False`` shows a failing
    program as it was found, unshrunk (the verdict is the same). Raises
    ``TargetSpecError`` if the string names no target, or the options do not
    fit the layer: those are the caller's mistakes, not the target's.
    """
    descriptor = target if isinstance(target, TargetDescriptor) else resolve(layer, target)
    if descriptor.layer != layer:
        raise TargetSpecError(f"{descriptor.spec} was resolved for the {descriptor.layer} layer")
    if level not in LEVELS[layer]:
        known = " and ".join(str(n) for n in LEVELS[layer])
        raise TargetSpecError(f"the {layer} layer has level(s) {known}, not {level}")
    if descriptor.factory is None:
        raise TargetSpecError(
            f"{descriptor.spec} runs in its own interpreter: use "
            f"`kvpool check --target {descriptor.spec}`"
        )
    name = target_name or descriptor.spec
    factory: Any = GuardedFactory(descriptor.factory, name)
    chosen = list(profiles or descriptor.profiles or ())
    options = RunOptions(
        hypothesis_profile=hypothesis_profile,
        max_examples=max_examples,
        steps=steps,
        seed=seed,
        target_name=name,
        on_example=on_example,
        program_timeout=program_timeout,
        shrink=shrink,
    )
    if layer == "pool":
        _known_profiles(chosen)
        return run_conformance(
            factory,
            level=level,
            profile=chosen or None,
            unsupported=descriptor.unsupported,
            **options,
        )
    if layer == "request":
        _known_profiles(chosen)
        return _check_request(descriptor, chosen, level, options)
    if layer == "events":
        return _check_events(descriptor, factory, list(profiles or ()), **options)
    if layer == "radix":
        return _check_radix(descriptor, factory, chosen, level, options)
    unknown = [d for d in chosen if d not in DISCIPLINES]
    if unknown or len(chosen) > 1:
        raise TargetSpecError(
            f"the v0 layer takes one discipline as its profile: {', '.join(DISCIPLINES)}"
        )
    discipline = chosen[0] if chosen else "any"
    return check_v0(factory, discipline, **options)


def _check_request(
    descriptor: TargetDescriptor, chosen: list[str], level: int, options: RunOptions
) -> ConformanceReport:
    """The main scope, then each of the descriptor's parts, until one fails: one report.

    Each part runs the whole budget (``max_examples``) as a check of its own; the report
    adds up programs and time, names each part's verdict and, on a failure, is that
    part's failure.
    """
    parts = (("main", descriptor.scope), *descriptor.parts)
    report: ConformanceReport | None = None
    on_example = options.get("on_example")
    for name, fields in parts:
        if report is not None and not report.conforms:
            report.parts[name] = "not run"
            continue
        # The request layer's recorder guards its factory itself, naming the setup as the
        # protocol writes it (kvpool.specs.request.record.build).
        scope = ManagerTargetSpec(descriptor.factory, **fields)  # type: ignore[arg-type]
        if chosen:
            scope = replace(scope, profiles=tuple(profile_named(p) for p in chosen))
        done = 0 if report is None else report.examples_run
        part_options = RunOptions(**options)
        if on_example is not None:
            part_options["on_example"] = _counted_from(done, on_example)
        part = run_request_conformance(scope, level=level, **part_options)
        if descriptor.parts and part.conforms and part.examples_run == 0:
            part.fail("nothing-ran", f"no program of the part {name!r} was run")
        if report is None:
            report = part
        else:
            _add_part(report, part)
        if descriptor.parts:
            report.parts[name] = verdict_of(part)
            if not part.conforms and name != "main":
                report.notes.append(f"the part {name!r} failed (the parts before it conform)")
    assert report is not None
    return report


def _counted_from(done: int, on_example: Callable[[int], None]) -> Callable[[int], None]:
    """``on_example`` told the programs of the parts before too."""
    return lambda n: on_example(done + n)


def _add_part(report: ConformanceReport, part: ConformanceReport) -> None:
    """Fold a later part's run into ``report`` (every part before it conformed)."""
    if not part.conforms:
        report.conforms = False
        report.failure_kind = part.failure_kind
        report.failure = part.failure
        report.program = part.program
        report.counterexample = part.counterexample
        report.shrunk = part.shrunk
        report.from_database = part.from_database
        if part.seconds_to_first_failure is not None:
            report.seconds_to_first_failure = report.seconds + part.seconds_to_first_failure
            report.programs_to_first_failure = report.examples_run + (
                part.programs_to_first_failure or 0
            )
            report.shrink_seconds = part.shrink_seconds
    report.examples_run += part.examples_run
    report.seconds += part.seconds
    if part.max_examples is not None:
        report.max_examples = (report.max_examples or 0) + part.max_examples
    report.notes.extend(note for note in part.notes if note not in report.notes)


class GuardedFactory:
    """A target factory whose own failures are target errors, not crashes of the check.

    A factory that raises something other than a rejection (a wrong
    signature, a missing dependency, a bug) makes the check end with a
    target error naming it. Other attributes (``close``, ``preflight``, a
    cmd: factory's ``levels``) pass through.
    """

    def __init__(self, factory: Callable[[Any], Any], name: str) -> None:
        self._factory = factory
        self._name = name

    def __call__(self, setup: Any) -> Any:
        try:
            return self._factory(setup)
        except (PoolError, TargetError, TargetAbort):
            raise
        except Exception as error:
            raise TargetError(
                f"the factory could not build a target for {setup!r:.300}: it raised "
                f"{type(error).__name__}: {error} (target {self._name})"
            ) from error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._factory, name)


def _check_radix(
    descriptor: TargetDescriptor,
    factory: Any,
    chosen: Sequence[str],
    level: int,
    options: RunOptions,
) -> ConformanceReport:
    """The radix layer: its profile is the eviction policy the target is built with."""
    if len(chosen) > 1 or any(p not in POLICIES for p in chosen):
        raise TargetSpecError(
            f"the radix layer takes one eviction policy as its profile: {', '.join(POLICIES)}"
        )
    preflight = descriptor.preflight
    return check_radix(
        factory,
        chosen[0] if chosen else "lru",
        level,
        events=descriptor.scope.get("events", (True, False)),
        preflight=None if preflight is None else (lambda: preflight(level, list(chosen))),
        **options,
    )


def _known_profiles(profiles: Sequence[str]) -> None:
    for name in profiles:
        try:
            profile_named(name)
        except InvalidConfig as error:
            raise TargetSpecError(str(error)) from None


def _check_events(
    descriptor: TargetDescriptor,
    factory: Any,
    semantics: list[str],
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """The events layer: a consumer against the model's engines, or a producer against the fold.

    ``semantics`` given: run under those and count them all (the caller claims
    them); not given: run under every event semantics, counting the ones the
    target claims.
    """
    unknown = [s for s in semantics if s not in EVENT_SEMANTICS]
    if unknown:
        raise TargetSpecError(
            f"unknown event semantics {unknown}; the events layer takes {list(EVENT_SEMANTICS)}"
        )
    producer = descriptor.scope.get("role") == "producer"
    return check_events(
        None if producer else factory,
        factory if producer else None,
        semantics=semantics or None,
        claimed=semantics or (None if descriptor.profiles is None else list(descriptor.profiles)),
        preflight=descriptor.preflight,
        **options,
    )


def replay_request_vectors(
    target: str | TargetDescriptor,
    vectors: Sequence[LoadedVector],
    *,
    levels: Sequence[int] | None = None,
    profiles: Sequence[str] | None = None,
    fail_fast: bool = False,
) -> RequestRunResult:
    """Replay request-layer vectors on a target, within what it claims; never raises for it.

    Manager vectors run where the target's scope, levels and profiles reach
    (its descriptor's and, for a ``cmd:`` program, its hello's); hash vectors
    run on a target that hashes with kvpool's function (a program whose hello
    says ``"hasher": "kvpool"``, or a factory with a ``hasher``). Raises
    ``TargetSpecError`` if the string names no request-layer target; a target
    that cannot be run is ``TargetError`` (or ``TargetAbort``).
    """
    descriptor = target if isinstance(target, TargetDescriptor) else resolve("request", target)
    factory = descriptor.factory
    if descriptor.layer != "request" or factory is None:
        raise TargetSpecError(
            f"{descriptor.spec} is not a request-layer target of this interpreter: "
            "replay vectors on it where it is installed"
        )
    scope = dict(descriptor.scope)
    declared = getattr(factory, "declared_scope", None)
    if declared is not None:
        scope.update(declared())
    chosen_levels = _within(levels, getattr(factory, "levels", None))
    claimed = getattr(factory, "profiles", None) or descriptor.profiles
    chosen_profiles = _within(profiles, claimed)
    kind = getattr(factory, "hasher_kind", None)
    hasher = getattr(factory, "hasher", None)
    if kind is not None:
        hasher = factory if kind == "kvpool" else None
    elif not callable(getattr(hasher, "block_hashes", None)):
        hasher = None
    return run_request_corpus(
        factory, vectors, chosen_levels, chosen_profiles, scope, hasher, fail_fast
    )


def _within(chosen: Sequence[Any] | None, declared: Any) -> list[Any] | None:
    """The chosen values (or all), within what the target declares, if it declares any."""
    values = list(chosen) if chosen else None
    if declared is None:
        return values
    return [x for x in (values or declared) if x in declared]
