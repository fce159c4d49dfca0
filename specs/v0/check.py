"""``check_v0``: checking a v0 allocator against the model of vLLM's v0 prefix-caching allocator."""

from collections.abc import Callable

from hypothesis import HealthCheck, Phase

from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import run_machine
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT
from kvpool.specs.v0.machine import v0_machine
from kvpool.specs.v0.target import V0TargetFactory


def check_v0(
    make_target: V0TargetFactory,
    discipline: str = "any",
    *,
    hypothesis_profile: str = "ci",
    max_examples: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    target_name: str = "target",
    shrink: bool = True,
    program_timeout: float | None = DEFAULT_PROGRAM_TIMEOUT,
    on_example: Callable[[int], None] | None = None,
) -> ConformanceReport:
    """Run the v0 machine against ``make_target`` and report whether it conforms.

    ``discipline`` is ``any`` (every valid program) or ``engine`` (what vLLM's
    v0 block manager does; ``kvpool.specs.v0.machine``); the report names it
    as its profile. ``shrink=False`` stops at the first failing program
    instead of shrinking it to a minimal one (faster, longer programs). The
    failing program is reported as the calls the target received, with the
    model's results.

    >>> from kvpool.specs.v0.model_target import ModelV0Target
    >>> check_v0(ModelV0Target, max_examples=5, steps=10).conforms
    True
    """
    machine = v0_machine(make_target, discipline)
    report = ConformanceReport(
        target=target_name, level=1, profiles=(discipline,), hypothesis_profile=hypothesis_profile
    )
    overrides: dict[str, object] = {"suppress_health_check": list(HealthCheck)}
    if not shrink:
        overrides["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    return run_machine(
        machine,
        report,
        hypothesis_profile=hypothesis_profile,
        max_examples=max_examples,
        steps=steps,
        seed=seed,
        program_timeout=program_timeout,
        on_example=on_example,
        traced_program=True,
        overrides=overrides,
    )
