"""``run_conformance``: the one entry point for checking a Python block pool."""

from collections.abc import Callable, Collection, Sequence

from kvpool.model import DEFAULT_PROFILE, PROFILES, Profile
from kvpool.specs.pool.counterexample import explain
from kvpool.specs.pool.machine import pool_machine
from kvpool.specs.pool.record import Recorder
from kvpool.specs.pool.target import TargetFactory
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import run_machine
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT


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
    unsupported: Collection[str] = (),
) -> ConformanceReport:
    """Check a block pool against the kvpool model and report whether it conforms.

    Paste this into your project and adapt the factory::

        from kvpool.model import PoolConfig
        from kvpool.specs import run_conformance

        def make_target(config: PoolConfig):
            # Return an object with the methods of kvpool.specs.PoolTarget,
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
    error (the target hangs); None removes the limit. ``unsupported`` names
    operations and features the target lacks (``kvpool.specs.pool.target``):
    no program uses them; a factory with an ``unsupported_operations()`` method
    adds what it returns.
    """
    profiles = _resolve_profiles(profile)
    report = ConformanceReport(
        target=target_name,
        level=level,
        profiles=tuple(p.name for p in profiles),
        hypothesis_profile=hypothesis_profile,
    )
    preflight = getattr(make_target, "preflight", None)
    # A factory may declare what its pool lacks (an old vLLM release does).
    declared = getattr(make_target, "unsupported_operations", None)
    if declared is not None:
        unsupported = frozenset(unsupported) | frozenset(declared())
    recorder = Recorder(make_target)
    machine = pool_machine(
        recorder,
        level=level,
        profiles=profiles,
        caching=caching,
        events=events,
        name="KVPoolConformance",
        unsupported=unsupported,
    )
    return run_machine(
        machine,
        report,
        hypothesis_profile=hypothesis_profile,
        max_examples=max_examples,
        steps=steps,
        seed=seed,
        program_timeout=program_timeout,
        on_example=on_example,
        preflight=None if preflight is None else lambda: preflight(level, report.profiles),
        explain=lambda failure: explain(recorder, target_name, failure),
    )


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
