"""``run_request_conformance``: checking a KV cache manager against the request layer's model."""

from dataclasses import replace
from typing import Any, Unpack

from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.request.counterexample import explain
from kvpool.specs.request.hisparse_machine import hisparse_machine
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.record import ManagerRecorder, build
from kvpool.specs.request.target import HYBRID_LAYOUTS, ManagerTargetSpec
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
        from kvpool.specs.request.target import HYBRID_LAYOUTS, ManagerTargetSpec

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

    A factory may have ``preflight(level, profile_names)``, raising
    ``TargetError`` when the target cannot be checked so (a program in
    another language says what it supports), and ``declared_scope()``, the
    part of the space it claims (a dict of ``ManagerTargetSpec`` fields):
    the check runs on what both the spec and the factory allow.
    """
    names = tuple(p.name for p in target.profiles)
    failed: BaseException | None = None
    hybrids = True
    try:
        preflight = getattr(target.factory, "preflight", None)
        if preflight is not None:
            preflight(level, names)
        declared = getattr(target.factory, "declared_scope", None)
        if declared is not None:
            claimed = declared()
            target = narrowed(target, claimed)
            hybrids = "layouts" not in claimed
    except (TargetError, TargetAbort) as error:
        failed = error

    def stop() -> None:
        if failed is not None:
            raise failed

    name = options.get("target_name", "target")
    if target.hisparse:
        # HiSparse's own machine (kvpool.specs.request.hisparse_machine): valid calls only,
        # its program told as the calls the target received
        factory = target.factory
        hisparse = hisparse_machine(
            lambda setup: build(factory, setup),
            profiles=target.profiles,
            events=target.events,
            name="KVPoolHiSparseConformance",
        )
        # level 1 whatever was asked: the HiSparse machine sends no call the model rejects
        return run_machine(hisparse, level=1, profiles=names, preflight=stop, **options)
    recorder = ManagerRecorder(target.factory)
    machine = manager_machine(
        recorder,
        layouts=target.layouts,
        profiles=target.profiles,
        name="KVPoolManagerConformance",
        events=target.events,
        block_factors=target.block_factors,
        min_window=target.min_window,
        level=level,
        hybrids=hybrids,
        uncached_layouts=target.uncached_layouts,
        hash_sized_layouts=target.hash_sized_layouts,
        fine_grained=target.fine_grained,
        in_flight=target.in_flight,
        scheduler_calls=target.scheduler_calls,
        prefill_lookaheads=target.prefill_lookaheads,
        eagle_hybrids=target.eagle_hybrids,
        context_parallel=target.context_parallel,
        retentions=target.retentions,
        connector_loads=target.connector_loads,
        eagle_flags=target.eagle_flags,
        mamba_reserves=target.mamba_reserves,
    )
    return run_machine(
        machine,
        level=level,
        profiles=names,
        preflight=stop,
        explain=lambda failure: explain(recorder, name, failure),
        **options,
    )


def narrowed(target: ManagerTargetSpec, claimed: dict[str, Any]) -> ManagerTargetSpec:
    """``target`` restricted to what a factory claims; TargetError if nothing is left.

    The claimed layouts may name level 2's hybrids (``HYBRID_LAYOUTS``); only
    what is claimed is drawn.
    """
    known = (*target.layouts, *(h for h in HYBRID_LAYOUTS if h not in target.layouts))
    layouts = tuple(x for x in known if x in claimed.get("layouts", target.layouts))
    events = tuple(e for e in target.events if e in claimed.get("events", target.events))
    factors = tuple(
        f for f in target.block_factors if f in claimed.get("block_factors", target.block_factors)
    )
    window = max(target.min_window, int(claimed.get("min_window", target.min_window)))
    if not (layouts and events and factors):
        raise TargetError(
            f"the target claims layouts {list(claimed.get('layouts', []))}, events "
            f"{list(claimed.get('events', []))} and block factors "
            f"{list(claimed.get('block_factors', []))}: nothing the check can run "
            f"(it can run layouts {list(target.layouts)}, events {list(target.events)}, "
            f"block factors {list(target.block_factors)})"
        )
    # fine-grained hits are an optional feature: the program's claim decides
    fine = tuple(claimed.get("fine_grained", target.fine_grained))
    # so is multi-module MTP's look-ahead (a constructor argument of vLLM 0.33 only)
    allowed = claimed.get("prefill_lookaheads", target.prefill_lookaheads)
    lookaheads = tuple(x for x in target.prefill_lookaheads if x in allowed) or (0,)
    return replace(
        target,
        layouts=layouts,
        events=events,
        block_factors=factors,
        min_window=window,
        fine_grained=fine,
        prefill_lookaheads=lookaheads,
        eagle_hybrids=bool(claimed.get("eagle_hybrids", target.eagle_hybrids)),
        # the rest of the scheduler calls and the in-flight caps: where both allow them
        scheduler_calls=target.scheduler_calls and bool(claimed.get("scheduler_calls", True)),
        in_flight=tuple(
            n for n in target.in_flight if n in claimed.get("in_flight", target.in_flight)
        )
        or (None,),
        # and a KV connector's loads (vLLM 0.33's allocate_slots arguments)
        connector_loads=bool(claimed.get("connector_loads", target.connector_loads)),
        eagle_flags=bool(claimed.get("eagle_flags", target.eagle_flags)),
        # and context parallelism: only the world sizes both allow, else none
        context_parallel=tuple(
            cp
            for cp in target.context_parallel
            if cp in claimed.get("context_parallel", target.context_parallel)
        )
        or ((1, 1),),
        # and sparse retention (a field of vLLM 0.33's KVCacheConfig): both must allow it
        retentions=tuple(
            r for r in target.retentions if r in claimed.get("retentions", target.retentions)
        )
        or (None,),
        # and HiSparse (vLLM 0.33's coordinator): both must allow it
        hisparse=target.hisparse and bool(claimed.get("hisparse", True)),
    )
