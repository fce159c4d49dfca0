"""``check_v0``: checking a v0 allocator against the model of vLLM's v0 prefix-caching allocator."""

from typing import Unpack

from hypothesis import HealthCheck

from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import RunOptions, run_machine
from kvpool.specs.v0.machine import v0_machine
from kvpool.specs.v0.target import V0TargetFactory


def check_v0(
    make_target: V0TargetFactory,
    discipline: str = "any",
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Run the v0 machine against ``make_target`` and report whether it conforms.

    ``discipline`` is ``any`` (every valid program) or ``engine`` (what vLLM's
    v0 block manager does; ``kvpool.specs.v0.machine``); the report names it
    as its profile. The failing program is reported as the calls the target received, with the
    model's results. ``options`` are the runner's
    (``kvpool.specs.runner.run.RunOptions``).

    >>> from kvpool.specs.v0.model_target import ModelV0Target
    >>> check_v0(ModelV0Target, max_examples=5, steps=10).conforms
    True
    """
    machine = v0_machine(make_target, discipline)
    return run_machine(
        machine,
        level=1,
        profiles=(discipline,),
        traced_program=True,
        overrides={"suppress_health_check": list(HealthCheck)},
        **options,
    )
