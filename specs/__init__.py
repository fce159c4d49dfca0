"""kvpool.specs: what conformance means, for every layer, and the kit that checks it.

The public face, for projects that check their own implementation::

    from kvpool.specs import check, run_conformance, PoolTarget, ConformanceReport

* ``check(layer, target)``: any layer, a target named by string (as ``kvpool check``);
* ``run_conformance(make_target)``: a Python block pool, built by a factory;
* ``run_request_conformance(ManagerTargetSpec(make_manager))``: a KV cache manager;
* ``check_v0(make_allocator)``: a v0 allocator;
* ``check_events(make_consumer)``: a KV-event consumer (a router's index), or
  ``check_events(None, make_engine)`` an engine's stream;
* ``check_radix(make_cache)``: a radix prefix cache (SGLang's design);
* the target protocols ``PoolTarget``, ``ManagerTarget``, ``V0Target``,
  ``Consumer`` and ``RadixTarget``;
* ``ConformanceReport``, and ``TargetError`` for a target that cannot be run.

The layers are packages with the same file names (``pool/``, ``request/``,
``v0/``, ``events/``, ``radix/``: ``target``, ``machine``, ``invariants``,
``check``) over one runner
(``runner/``) and one target registry (``targets/``); docs/architecture.md
draws the floors.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.specs.checking import check
    from kvpool.specs.errors import Divergence, InvariantViolation, TargetError
    from kvpool.specs.events.check import check_events
    from kvpool.specs.events.target import Consumer, ConsumerConfig
    from kvpool.specs.pool.check import run_conformance
    from kvpool.specs.pool.target import PoolTarget, Snapshottable, TargetFactory
    from kvpool.specs.radix.check import check_radix
    from kvpool.specs.radix.target import RadixTarget
    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.request.target import ManagerSetup, ManagerTarget, ManagerTargetSpec
    from kvpool.specs.runner.report import ConformanceReport, Counterexample
    from kvpool.specs.targets import TargetDescriptor, TargetSpecError, resolve
    from kvpool.specs.v0.check import check_v0
    from kvpool.specs.v0.target import V0Target

# Loaded on first use, so that importing one small module of kvpool.specs (a
# protocol server in a target's process, say) does not load Hypothesis and the
# whole kit with it.
_PUBLIC = {
    "check": "kvpool.specs.checking",
    "Divergence": "kvpool.specs.errors",
    "InvariantViolation": "kvpool.specs.errors",
    "TargetError": "kvpool.specs.errors",
    "check_events": "kvpool.specs.events.check",
    "Consumer": "kvpool.specs.events.target",
    "ConsumerConfig": "kvpool.specs.events.target",
    "run_conformance": "kvpool.specs.pool.check",
    "PoolTarget": "kvpool.specs.pool.target",
    "Snapshottable": "kvpool.specs.pool.target",
    "TargetFactory": "kvpool.specs.pool.target",
    "check_radix": "kvpool.specs.radix.check",
    "RadixTarget": "kvpool.specs.radix.target",
    "run_request_conformance": "kvpool.specs.request.check",
    "ManagerSetup": "kvpool.specs.request.target",
    "ManagerTarget": "kvpool.specs.request.target",
    "ManagerTargetSpec": "kvpool.specs.request.target",
    "ConformanceReport": "kvpool.specs.runner.report",
    "Counterexample": "kvpool.specs.runner.report",
    "TargetDescriptor": "kvpool.specs.targets",
    "TargetSpecError": "kvpool.specs.targets",
    "resolve": "kvpool.specs.targets",
    "check_v0": "kvpool.specs.v0.check",
    "V0Target": "kvpool.specs.v0.target",
}

__all__ = [
    "ConformanceReport",
    "Consumer",
    "ConsumerConfig",
    "Counterexample",
    "Divergence",
    "InvariantViolation",
    "ManagerSetup",
    "ManagerTarget",
    "ManagerTargetSpec",
    "PoolTarget",
    "RadixTarget",
    "Snapshottable",
    "TargetDescriptor",
    "TargetError",
    "TargetFactory",
    "TargetSpecError",
    "V0Target",
    "check",
    "check_events",
    "check_radix",
    "check_v0",
    "resolve",
    "run_conformance",
    "run_request_conformance",
]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvpool.specs' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
