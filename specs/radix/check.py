"""``check_radix``: checking a radix cache against the model of SGLang's radix prefix cache."""

from collections.abc import Callable, Collection, Sequence
from typing import Unpack

from hypothesis import HealthCheck

from kvpool.specs.radix.machine import PAGE_SIZES, radix_machine
from kvpool.specs.radix.target import RadixTargetFactory
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import RunOptions, run_machine


def check_radix(
    make_target: RadixTargetFactory,
    policy: str = "lru",
    level: int = 1,
    *,
    events: Sequence[bool] = (True, False),
    page_sizes: Sequence[int] = PAGE_SIZES,
    skip: Collection[tuple[str, str]] = (),
    preflight: Callable[[], None] | None = None,
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Run the radix machine against ``make_target`` and report whether it conforms.

    ``policy`` is the eviction policy the target is built with and claims
    (``kvpool.model.radix.POLICIES``); the report names it as its profile.
    ``events`` and ``page_sizes`` are the configurations programs are drawn
    from. ``skip`` names (operation, model error) pairs not sent at level 2
    (known findings, ``kvpool.specs.targets.sglang.findings.skip_for``).
    ``preflight`` may raise ``TargetError`` before any program runs.
    The failing program is reported as the calls the target received, with the
    model's results.
    ``options`` are the runner's (``kvpool.specs.runner.run.RunOptions``).

    >>> from kvpool.specs.radix.model_target import ModelRadixTarget
    >>> check_radix(ModelRadixTarget, max_examples=5, steps=10).conforms
    True
    """
    machine = radix_machine(
        make_target, policy, level, events=events, page_sizes=page_sizes, skip=skip
    )
    return run_machine(
        machine,
        level=level,
        profiles=(policy,),
        preflight=preflight,
        traced_program=True,
        overrides={"suppress_health_check": list(HealthCheck)},
        **options,
    )
