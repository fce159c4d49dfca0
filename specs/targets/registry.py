"""Turning a target string into a ``TargetDescriptor``, for one layer.

Target strings, and the layers each works at:

=========================  ====  =======  ==  ======  =====
string                     pool  request  v0  events  radix
=========================  ====  =======  ==  ======  =====
``impl``                   yes   yes      no  yes     no
``model``                  yes   yes      yes yes     yes
``module:factory``         yes   yes      yes yes     yes
``cmd:PROGRAM ARGS``       yes   yes      no  yes     no
``vllm``                   yes   yes      yes yes     no
``vllm:module:Class``      yes   yes      no  yes     no
``vllm==X.Y.Z``            yes   yes      no  no      no
``dynamo``                 no    no       no  yes     no
``dynamo:raw``             no    no       no  yes     no
``pool:SPEC``              no    no       no  yes     no
``sglang``                 no    no       no  no      yes
``sglang:CORE``            no    no       no  no      yes
``sglang:module:Class``    no    no       no  no      yes
``sglang==X.Y.Z``          no    no       no  no      yes
=========================  ====  =======  ==  ======  =====

At the events layer ``impl``, ``vllm``, ``vllm:module:Class`` and ``pool:SPEC``
are producers, ``model`` is the reference consumer, the others consumers
(``dynamo``: as deployed; ``dynamo:raw``: the bare index).

* ``impl``: kvpool's own fast implementation (the default);
* ``model``: the model itself (a self-check of the harness);
* ``module:factory``: any importable callable taking the layer's setup
  (``PoolConfig``, ``ManagerSetup`` or ``V0Config``); at the request layer
  also a ``ManagerTargetSpec`` (a factory with the part of the space it is
  checked on);
* ``cmd:PROGRAM ARGS``: a program in any language speaking the JSON-lines
  protocol of the layer (docs/formats.md, ``kvpool.specs.targets.cmd``);
* ``vllm``: the installed vLLM (its ``BlockPool``, ``KVCacheManager`` or v0 allocator);
* ``vllm:package.module:Class``: a ``BlockPool`` (pool layer) or
  ``KVCacheManager`` (request layer) subclass or fork;
* ``vllm==X.Y.Z``: a vLLM release, checked by ``kvpool check`` in a child
  interpreter (``kvpool.specs.targets.vllm.releases``);
* ``dynamo``, ``dynamo:raw``: NVIDIA Dynamo's router index, with and without
  the publisher's duplicate filter (``kvpool.specs.targets.dynamo``);
* ``sglang``: the installed SGLang's radix cache as its server builds it
  (``UnifiedRadixCache``, Rust tree core by default); ``sglang:rust``,
  ``sglang:python`` and ``sglang:legacy`` (``RadixCache``) choose the core;
  ``sglang:package.module:Class`` a subclass of either cache; ``sglang==X.Y.Z``
  the installed SGLang if it is release X.Y.Z (``kvpool.specs.targets.sglang``).

At the events layer a target is a KV-event *consumer* (checked against the
model's engines) or a *producer* (a pool whose events the reference consumer
folds); ``scope["role"]`` says which.

The registry resolves a string once; the descriptor says everything the
check needs: the factory, the profiles the target claims, the operations it
supports, its preflight, and whether it runs in a child interpreter.
"""

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.specs.events import target as events_target
from kvpool.specs.pool import target as pool_target
from kvpool.specs.pool.target import TargetFactory
from kvpool.specs.radix import target as radix_target
from kvpool.specs.request import target as request_target
from kvpool.specs.targets.importing import import_from_here
from kvpool.specs.targets.sglang.loading import INSTALL_HINT as SGLANG_INSTALL_HINT
from kvpool.specs.targets.sglang.loading import RELEASE_PREFIX as RELEASE_PREFIX_SGLANG
from kvpool.specs.targets.sglang.loading import SGLANG
from kvpool.specs.targets.sglang.loading import installed_version as sglang_installed_version
from kvpool.specs.targets.sglang.loading import release_of as sglang_release_of
from kvpool.specs.targets.vllm.releases import (
    RELEASE_ENV,
    VLLM,
    ReleaseError,
    default_profile_for,
    installed_version,
    is_vllm_target,
    release_of,
)
from kvpool.specs.v0 import target as v0_target

LAYERS = ("pool", "request", "v0", "events", "radix")
"""The layers a target can be checked at: vLLM's v1 block pool, the request layer
over it (a KV cache manager), vLLM's v0 allocator, the KV events between
engines and a router (consumers and producers), and SGLang's radix prefix cache."""

OPERATIONS: Mapping[str, tuple[str, ...]] = {
    "pool": (*pool_target.OPERATIONS, *pool_target.FEATURES),
    "request": request_target.OPERATIONS,
    "v0": v0_target.OPERATIONS,
    "events": events_target.OPERATIONS,
    "radix": radix_target.OPERATIONS,
}
"""What a target of each layer may support: its operations, and the pool's features."""


class TargetSpecError(ValueError):
    """The target string names no usable target for the layer."""


@dataclass(frozen=True)
class TargetDescriptor:
    """What a target string names at one layer: everything a check needs to run it."""

    layer: str
    spec: str
    """The target string, as given."""
    factory: Callable[[Any], Any] | None
    """Builds a fresh target per program from the layer's setup; None when the
    target runs in a child interpreter (``release``)."""
    profiles: tuple[str, ...] | None = None
    """The semantics profiles the target claims; None: the user's choice or the default.
    At the events layer: the event semantics (``multiset``, ``last-copy``)."""
    unsupported: frozenset[str] = frozenset()
    """Operations and features of the layer (``OPERATIONS``) the target lacks."""
    preflight: Callable[[int, Sequence[str]], None] | None = None
    """Fails fast (``TargetError``), before any program, if the target cannot be
    checked at this level and these profiles."""
    scope: Mapping[str, Any] = field(default_factory=dict)
    """The part of the layer's space the target is checked on (request layer:
    ``layouts``, ``events``, ``block_factors``, ``min_window``, ``uncached_layouts``,
    ``hash_sized_layouts``; radix layer:
    ``events``)."""
    release: str | None = None
    """A vLLM release to check in a child interpreter that imports it."""
    parts: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    """Further parts of the layer's space, each (name, scope), checked after ``scope`` one
    by one until one fails (request layer: ``request_target.PARTS_033``, what vLLM 0.33
    added that the main scope does not draw)."""

    @property
    def operations(self) -> frozenset[str]:
        """The operations and features of the layer the target supports."""
        return frozenset(OPERATIONS[self.layer]) - self.unsupported

    @property
    def in_child(self) -> bool:
        """Whether the check runs in a child interpreter (another vLLM release)."""
        return self.release is not None and self.factory is None


def resolve(layer: str, spec: str) -> TargetDescriptor:
    """The descriptor a target string names at ``layer``; TargetSpecError if there is none."""
    if layer not in LAYERS:
        raise TargetSpecError(f"unknown layer {layer!r}: use {', '.join(LAYERS)}")
    if not isinstance(spec, str) or not spec.strip():
        raise TargetSpecError("the target string is empty")
    if layer != "radix" and is_sglang_target(spec):
        raise TargetSpecError(
            f"{spec!r} is an SGLang radix cache: check it at the radix layer (--layer radix)"
        )
    resolvers = {"pool": _pool, "request": _request, "v0": _v0, "events": _events}
    return {**resolvers, "radix": _radix}[layer](spec)


def resolve_target(spec: str) -> TargetFactory:
    """The pool target factory a target string names (``resolve("pool", spec)``)."""
    descriptor = resolve("pool", spec)
    if descriptor.factory is None:
        raise TargetSpecError(
            f"{spec} runs in its own interpreter: use `kvpool check --target {spec}` "
            "or kvpool.specs.targets.vllm.releases.run_check_in_release"
        )
    return descriptor.factory


# --------------------------------------------------------------------------
# The pool layer
# --------------------------------------------------------------------------


def _pool(spec: str) -> TargetDescriptor:
    if spec == "impl":
        from kvpool.specs.targets.impl.pool import ImplTarget

        return TargetDescriptor("pool", spec, ImplTarget)
    if spec == "model":
        from kvpool.specs.pool.model_target import ModelTarget

        return TargetDescriptor("pool", spec, ModelTarget)
    if spec.startswith("cmd:"):
        from kvpool.specs.targets.cmd.pool import CmdTargetFactory

        try:
            factory = CmdTargetFactory.from_spec(spec)
        except ValueError as error:
            raise TargetSpecError(f"bad cmd: target {spec!r}: {error}") from error
        return TargetDescriptor("pool", spec, factory, preflight=factory.preflight)
    if is_vllm_target(spec):
        return _vllm_pool(spec)
    return _module_factory("pool", spec)


def _vllm_pool(spec: str) -> TargetDescriptor:
    try:
        release = release_of(spec)
        profiles = default_profile_for(spec)
    except ReleaseError as error:
        raise TargetSpecError(str(error)) from error
    claimed = None if profiles is None else tuple(profiles)
    if release is not None and not _in_release_child(release):
        return TargetDescriptor("pool", spec, None, profiles=claimed, release=release)
    if installed_version() is None:
        raise TargetSpecError(
            "vLLM is not installed: pip install vllm, or use --target vllm==X.Y.Z"
        )
    from kvpool.specs.targets.vllm.pool import vllm_factory

    try:
        factory = vllm_factory(VLLM if release is not None else spec)
    except ValueError as error:
        raise TargetSpecError(str(error)) from error
    return TargetDescriptor(
        "pool",
        spec,
        factory,
        profiles=claimed,
        unsupported=factory.unsupported_operations(),
        preflight=factory.preflight,
        release=release,
    )


def _in_release_child(release: str) -> bool:
    """Whether this interpreter is the child that ``kvpool check`` started for ``release``."""
    return os.environ.get(RELEASE_ENV) == release == installed_version()


# --------------------------------------------------------------------------
# The request layer
# --------------------------------------------------------------------------


PREFILL_LOOKAHEADS = (0, 0, 1, 2, 3)
"""The ``num_prefill_lookahead`` values drawn where a target takes them (0 most often)."""

RETENTIONS = (None, None, 0, 1, 2)
"""The retention intervals drawn where a target takes them, in scheduler blocks (None, dense,
most often; ``ManagerTargetSpec.retentions``)."""


def _request(spec: str) -> TargetDescriptor:
    if spec == "impl":
        from kvpool.specs.targets.impl.request import ImplManagerTarget

        return TargetDescriptor(
            "request",
            spec,
            ImplManagerTarget,
            scope={
                "fine_grained": (False, True),
                "prefill_lookaheads": PREFILL_LOOKAHEADS,
                "eagle_hybrids": True,
                "retentions": RETENTIONS,
            },
            parts=request_target.PARTS_033_HISPARSE,
        )
    if spec == "model":
        from kvpool.specs.request.model_target import ModelManagerTarget

        return TargetDescriptor(
            "request",
            spec,
            ModelManagerTarget,
            scope={
                "fine_grained": (False, True),
                "prefill_lookaheads": PREFILL_LOOKAHEADS,
                "eagle_hybrids": True,
                "retentions": RETENTIONS,
            },
            parts=request_target.PARTS_033_HISPARSE,
        )
    if spec.startswith("cmd:"):
        from kvpool.specs.targets.cmd.request import CMD_SCOPE, CmdManagerFactory

        try:
            factory = CmdManagerFactory.from_spec(spec)
        except ValueError as error:
            raise TargetSpecError(f"bad cmd: target {spec!r}: {error}") from error
        # every optional feature, narrowed to what the program's hello announces
        return TargetDescriptor(
            "request", spec, factory, preflight=factory.preflight, scope=dict(CMD_SCOPE)
        )
    if is_vllm_target(spec):
        return _vllm_request(spec)
    return _module_factory("request", spec)


def _vllm_request(spec: str) -> TargetDescriptor:
    try:
        release = release_of(spec)
        profiles = default_profile_for(spec)
    except ReleaseError as error:
        raise TargetSpecError(str(error)) from error
    claimed = None if profiles is None else tuple(profiles)
    if release is not None and not _in_release_child(release):
        return TargetDescriptor("request", spec, None, profiles=claimed, release=release)
    if installed_version() is None:
        raise TargetSpecError(
            "vLLM is not installed: pip install vllm, or use --target vllm==X.Y.Z"
        )
    from kvpool.specs.targets.vllm.request import scope, vllm_manager_factory

    try:
        factory = vllm_manager_factory(VLLM if release is not None else spec)
    except ValueError as error:
        raise TargetSpecError(str(error)) from error
    # What vLLM 0.33 added is compared on 0.33 only (the adapter drives it on that API)
    version = installed_version() or ""
    parts = request_target.PARTS_033_HISPARSE if version.startswith("0.33") else ()
    return _from_scope(spec, scope(factory), release=release, parts=parts)


def _from_scope(
    spec: str,
    scope: request_target.ManagerTargetSpec,
    release: str | None = None,
    parts: tuple[tuple[str, Mapping[str, Any]], ...] = (),
) -> TargetDescriptor:
    return TargetDescriptor(
        "request",
        spec,
        scope.factory,
        profiles=tuple(p.name for p in scope.profiles),
        preflight=getattr(scope.factory, "preflight", None),
        release=release,
        scope={
            "layouts": scope.layouts,
            "events": scope.events,
            "block_factors": scope.block_factors,
            "min_window": scope.min_window,
            "uncached_layouts": scope.uncached_layouts,
            "hash_sized_layouts": scope.hash_sized_layouts,
            "fine_grained": scope.fine_grained,
            "in_flight": scope.in_flight,
            "scheduler_calls": scope.scheduler_calls,
            "prefill_lookaheads": scope.prefill_lookaheads,
            "eagle_hybrids": scope.eagle_hybrids,
            "context_parallel": scope.context_parallel,
            "retentions": scope.retentions,
            "connector_loads": scope.connector_loads,
            "eagle_flags": scope.eagle_flags,
        },
        parts=parts,
    )


# --------------------------------------------------------------------------
# The v0 layer
# --------------------------------------------------------------------------


def _v0(spec: str) -> TargetDescriptor:
    if spec == "model":
        from kvpool.specs.v0.model_target import ModelV0Target

        return TargetDescriptor("v0", spec, ModelV0Target)
    if spec == VLLM:
        from kvpool.specs.targets.vllm.v0 import make_vllm_v0_target, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise TargetSpecError(f"vLLM's v0 allocator cannot be loaded: {reason}")
        return TargetDescriptor("v0", spec, make_vllm_v0_target)
    if spec == "impl" or spec.startswith("cmd:") or is_vllm_target(spec):
        raise TargetSpecError(
            f"{spec!r} cannot be checked at the v0 layer: use model, vllm "
            "or module:factory (a callable taking a V0Config)"
        )
    return _module_factory("v0", spec)


# --------------------------------------------------------------------------
# The events layer
# --------------------------------------------------------------------------

CONSUMER, PRODUCER = "consumer", "producer"


def _events(spec: str) -> TargetDescriptor:
    if spec == "model":
        from kvpool.specs.events.model_target import ReferenceConsumer

        return _consumer(spec, ReferenceConsumer)
    if spec in ("dynamo", "dynamo:raw"):
        from kvpool.specs.targets.dynamo.radix_tree import DynamoConsumerFactory

        factory = DynamoConsumerFactory("raw" if spec.endswith(":raw") else "deployed")
        return _consumer(spec, factory, preflight=factory.preflight)
    if spec.startswith("cmd:"):
        from kvpool.specs.targets.cmd.consumer import CmdConsumerFactory

        try:
            cmd = CmdConsumerFactory.from_spec(spec)
        except ValueError as error:
            raise TargetSpecError(f"bad cmd: target {spec!r}: {error}") from error
        return _consumer(spec, cmd, preflight=cmd.preflight, claims=None)
    if spec.startswith("pool:") or spec == "impl" or is_vllm_target(spec):
        pool_spec = spec[len("pool:") :] if spec.startswith("pool:") else spec
        return _producer(spec, pool_spec)
    descriptor = _module_factory("events", spec)
    from kvpool.specs.events.target import claimed_semantics

    return TargetDescriptor(
        "events",
        spec,
        descriptor.factory,
        profiles=claimed_semantics(descriptor.factory),
        unsupported=descriptor.unsupported,
        preflight=descriptor.preflight,
        scope={"role": CONSUMER},
    )


def _consumer(
    spec: str,
    factory: Callable[[Any], Any],
    preflight: Callable[[int, Sequence[str]], None] | None = None,
    claims: tuple[str, ...] | None = (),
) -> TargetDescriptor:
    from kvpool.specs.events.target import claimed_semantics

    return TargetDescriptor(
        "events",
        spec,
        factory,
        profiles=claimed_semantics(factory) if claims == () else claims,
        preflight=preflight,
        scope={"role": CONSUMER},
    )


def _producer(spec: str, pool_spec: str) -> TargetDescriptor:
    """A pool target as an engine publishing events (``kvpool.specs.events.engine``)."""
    from kvpool.model import EVENT_SEMANTICS
    from kvpool.model.profiles import profile_named
    from kvpool.specs.events.engine import PoolEngineFactory

    try:
        pool = _pool(pool_spec)
    except TargetSpecError as error:
        raise TargetSpecError(f"{spec}: {error}") from error
    if pool.factory is None:
        raise TargetSpecError(
            f"{spec} runs in its own interpreter; at the events layer use the installed "
            "vLLM (--target vllm)"
        )
    if "events" in pool.unsupported:
        raise TargetSpecError(f"{spec}: this pool publishes no events")
    # A pool claims the event semantics of the profiles it claims; a pool that
    # names none publishes what every vLLM release does.
    named = [profile_named(p).event_semantics.value for p in pool.profiles or ()]
    claims = tuple(s for s in EVENT_SEMANTICS if s in named) or ("multiset",)
    if pool_spec == "impl":
        claims = tuple(EVENT_SEMANTICS)
    pool_preflight = pool.preflight
    return TargetDescriptor(
        "events",
        spec,
        PoolEngineFactory(pool.factory, pool_spec),
        profiles=claims,
        preflight=None if pool_preflight is None else lambda level, _: pool_preflight(level, ()),
        scope={"role": PRODUCER},
    )


# --------------------------------------------------------------------------
# The radix layer
# --------------------------------------------------------------------------


def is_sglang_target(spec: str) -> bool:
    """Whether ``spec`` names an SGLang target (``sglang``, ``sglang:...``, ``sglang==X``)."""
    return spec == SGLANG or spec.startswith((f"{SGLANG}:", RELEASE_PREFIX_SGLANG))


def _radix(spec: str) -> TargetDescriptor:
    if spec == "model":
        from kvpool.specs.radix.model_target import ModelRadixTarget

        return TargetDescriptor("radix", spec, ModelRadixTarget)
    if is_sglang_target(spec):
        return _sglang(spec)
    if spec == "impl" or spec.startswith("cmd:") or is_vllm_target(spec):
        raise TargetSpecError(
            f"{spec!r} cannot be checked at the radix layer: use model, sglang, sglang:CORE, "
            "sglang:module:Class, sglang==X.Y.Z or module:factory (a callable taking a "
            "RadixConfig)"
        )
    return _module_factory("radix", spec)


def _sglang(spec: str) -> TargetDescriptor:
    from kvpool.specs.targets.sglang.radix import CORES, SglangRadixFactory

    try:
        release = sglang_release_of(spec)
    except ValueError as error:
        raise TargetSpecError(str(error)) from error
    installed = sglang_installed_version()
    if installed is None:
        raise TargetSpecError(f"SGLang is not installed: {SGLANG_INSTALL_HINT}")
    if release is not None and release != installed:
        raise TargetSpecError(
            f"{spec}: SGLang {installed} is installed here, not {release}; install "
            f"sglang=={release} (docs/sglang-conformance.md) or check --target sglang"
        )
    rest = "" if release is not None or spec == SGLANG else spec[len(SGLANG) + 1 :]
    if rest in CORES or not rest:
        factory = SglangRadixFactory(rest or "default")
    else:
        cache_class = _sglang_class(rest)
        factory = SglangRadixFactory(cache_class=cache_class[1], core=cache_class[0])
    return TargetDescriptor(
        "radix", spec, factory, preflight=factory.preflight, scope={"events": (True, False)}
    )


def _sglang_class(spec: str) -> tuple[str, Any]:
    """The core and class ``package.module:Class`` names: a subclass of one of SGLang's caches."""
    from kvpool.specs.errors import TargetError
    from kvpool.specs.targets.sglang.loading import load_sglang

    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise TargetSpecError(
            f"unknown SGLang target sglang:{spec}: use a core (default, rust, python, legacy) "
            "or package.module:Class"
        )
    try:
        api = load_sglang()
        module = import_from_here(module_name)
    except TargetError as error:
        raise TargetSpecError(str(error)) from error
    except ImportError as error:
        raise TargetSpecError(f"cannot import {module_name!r}: {error}") from error
    cls = getattr(module, attribute, None)
    if isinstance(cls, type) and issubclass(cls, api.unified_radix_cache):
        return "default", cls
    if isinstance(cls, type) and issubclass(cls, api.radix_cache):
        return "legacy", cls
    raise TargetSpecError(
        f"{module_name}:{attribute} is not a subclass of SGLang's RadixCache or UnifiedRadixCache"
    )


# --------------------------------------------------------------------------
# Any layer
# --------------------------------------------------------------------------


def _signature_problem(factory: Callable[..., Any]) -> str | None:
    """Why ``factory`` cannot be called with one positional argument, or None if it can."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: it will say so when called
    try:
        signature.bind(object())
    except TypeError as error:
        return f"its signature {signature} does not allow that ({error})"
    return None


def _module_factory(layer: str, spec: str) -> TargetDescriptor:
    if ":" not in spec:
        raise TargetSpecError(
            f"unknown target {spec!r}: use impl, model, module:factory, cmd:PROGRAM ARGS, "
            "vllm, vllm:module:Class, vllm==X.Y.Z or (radix layer) sglang"
        )
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise TargetSpecError(f"malformed target {spec!r}: use module:factory")
    try:
        module = import_from_here(module_name)
    except ImportError as error:
        raise TargetSpecError(f"cannot import {module_name!r}: {error}") from error
    factory = getattr(module, attribute, None)
    if layer == "request" and isinstance(factory, request_target.ManagerTargetSpec):
        return _from_scope(spec, factory)
    if not callable(factory):
        raise TargetSpecError(f"{module_name!r} has no callable {attribute!r}")
    problem = _signature_problem(factory)
    if problem is not None:
        setup = {"pool": "PoolConfig", "request": "ManagerSetup", "v0": "V0Config"}[layer]
        raise TargetSpecError(
            f"{spec} cannot be a {layer} target factory: it must take one argument "
            f"(a {setup}) and {problem}"
        )
    unsupported = getattr(factory, "unsupported_operations", None)
    return TargetDescriptor(
        layer,
        spec,
        factory,
        unsupported=frozenset(unsupported()) if callable(unsupported) else frozenset(),
        preflight=getattr(factory, "preflight", None),
    )
