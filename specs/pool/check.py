"""``run_conformance``: the one entry point for checking a Python block pool."""

from collections.abc import Collection, Sequence
from typing import Unpack

from kvpool.model import DEFAULT_PROFILE, InvalidConfig, Profile
from kvpool.model.profiles import profile_named
from kvpool.specs.pool.counterexample import explain, program_lines
from kvpool.specs.pool.machine import pool_machine
from kvpool.specs.pool.record import Recorder
from kvpool.specs.pool.target import OPT_IN_FEATURES, TargetFactory
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import RunOptions, run_machine


def run_conformance(
    make_target: TargetFactory,
    level: int = 1,
    profile: str | Profile | Sequence[str | Profile] | None = None,
    *,
    caching: Sequence[bool] = (True, False),
    events: Sequence[bool] = (False, True),
    unsupported: Collection[str] = (),
    **options: Unpack[RunOptions],
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
    the seeds' ``hashless-first``). ``options`` are the runner's
    (``kvpool.specs.runner.run.RunOptions``): ``hypothesis_profile`` is ``ci``
    (derandomized), ``dev``, ``deep`` or ``fuzz``; ``max_examples``, ``steps``
    and ``seed`` override it; ``target_name``, ``on_example``,
    ``program_timeout``. Never raises for a divergence: the report says what
    failed and prints the shrunk program. ``unsupported`` names
    operations and features the target lacks (``kvpool.specs.pool.target``):
    no program uses them; a factory with an ``unsupported_operations()`` method
    adds what it returns.
    """
    profiles = _resolve_profiles(profile)
    names = tuple(p.name for p in profiles)
    preflight = getattr(make_target, "preflight", None)
    # A factory may declare what its pool lacks (an old vLLM release does).
    declared = getattr(make_target, "unsupported_operations", None)
    if declared is not None:
        unsupported = frozenset(unsupported) | frozenset(declared())
    else:
        # A target that says nothing may predate vLLM 0.33's features.
        unsupported = frozenset(unsupported) | frozenset(OPT_IN_FEATURES)
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
    # The failing program as the protocol operations the target received, numbered
    # as the counterexample counts steps (not the machine's rule names).
    machine.program_lines = lambda self: program_lines(recorder)  # type: ignore[method-assign]
    return run_machine(
        machine,
        level=level,
        profiles=names,
        **options,
        preflight=None if preflight is None else lambda: preflight(level, names),
        explain=lambda failure: explain(recorder, options.get("target_name", "target"), failure),
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
        else:
            try:
                chosen.append(profile_named(p))
            except InvalidConfig as error:
                raise ValueError(str(error)) from None
    return chosen
