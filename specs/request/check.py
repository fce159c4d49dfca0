"""``run_request_conformance``: checking a KV cache manager against the request layer's model."""

from typing import Unpack

from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.target import ManagerTargetSpec
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import RunOptions, run_machine


def run_request_conformance(
    target: ManagerTargetSpec,
    *,
    level: int = 1,
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Check a KV cache manager against the model: a ``ConformanceReport``, never a raise.

    Paste this into your project and adapt the factory::

        from kvpool.specs.request.check import run_request_conformance
        from kvpool.specs.request.target import ManagerTargetSpec

        def make_manager(setup):
            # Return an object with the methods of kvpool.specs.request.target.ManagerTarget,
            # built for setup.num_blocks, setup.specs (one KV cache group each),
            # setup.max_model_len, setup.hash_block_size, setup.enable_caching, ...
            return MyManagerAdapter(setup)

        report = run_request_conformance(ManagerTargetSpec(make_manager), level=1)
        assert report.conforms, report.failure

    ``target`` also says which part of the machine's space the manager is
    checked on (layouts, profiles, events, block sizes, windows). ``options``
    are the runner's (``kvpool.specs.runner.run.RunOptions``).
    """
    machine = manager_machine(
        target.factory,
        layouts=target.layouts,
        profiles=target.profiles,
        name="KVPoolManagerConformance",
        events=target.events,
        block_factors=target.block_factors,
        min_window=target.min_window,
        level=level,
    )
    return run_machine(
        machine, level=level, profiles=tuple(p.name for p in target.profiles), **options
    )
