"""``cmd:PROGRAM ARGS`` at the request layer: a KV cache manager in any language, over JSON lines.

The kit starts the program once per run and keeps it: every test case
begins with ``new_manager``, which replaces the program's manager. The
dialect is the request layer's (``kvpool.specs.protocol.request_codec``,
docs/formats.md): the kit says ``hello`` with ``"layer": "request"``, and
the program answers with the levels, profiles and layouts it supports,
whether it has a ``snapshot``, and whether it hashes requests itself
(``"hasher": "own"`` or ``"kvpool"``: then the kit asks for its hashes and
checks them against the token ground truth,
``kvpool.specs.request.invariants``; ``"kvpool"`` also says it is kvpool's
hash function, so the hash vectors apply), and the optional features it has
(``features``, ``request_codec.FEATURES``): it is asked the calls and sent the
setups of those only (``FEATURE_SCOPES``).

A program that crashes, hangs, prints garbage or answers out of turn is a
``TargetError`` naming the operation, exactly as at the pool layer: both
run on the layer-neutral ``Session`` (``kvpool.specs.targets.cmd.session``),
with the same bounds, timeouts and process group.
"""

import shlex
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from kvpool.model import DEFAULT_PROFILE, PROFILES, InvalidConfig, KVCacheEvent, PoolError
from kvpool.model import manager as model_manager
from kvpool.model.manager import Blocks, KVCacheManagerState, PrefixCacheStats
from kvpool.model.profiles import profile_named
from kvpool.model.request import Request
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.request.target import (
    HYBRID_LAYOUTS,
    LAYOUTS,
    OPERATIONS_033,
    OPERATIONS_SCHEDULER,
    ManagerSetup,
    geometry_arguments,
    retention_arguments,
)
from kvpool.specs.targets.cmd.session import Dialect, Session, SessionFailure

QUERIES = frozenset({"get_block_ids", "usage", "num_free_blocks", "snapshot", "block_hashes"})
"""What the kit asks after every step to compare: not listed as the program's operations."""

SCOPE_FIELDS = ("layouts", "events", "block_factors", "min_window")
"""What a hello may say about the part of the machine's space the target supports."""

FEATURE_SCOPES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fine_grained": ({"fine_grained": (False, True)}, {"fine_grained": (False,)}),
    "scheduler_calls": (
        {"scheduler_calls": True, "in_flight": (None, 1, 3)},
        {"scheduler_calls": False, "in_flight": (None,)},
    ),
    "prefill_lookahead": (
        # those drawn for kvpool's own targets (registry.PREFILL_LOOKAHEADS: a test keeps
        # them equal; importing the registry here would load every engine's adapter module)
        {"prefill_lookaheads": (0, 0, 1, 2, 3)},
        {"prefill_lookaheads": (0,)},
    ),
    "eagle_hybrids": ({"eagle_hybrids": True}, {"eagle_hybrids": False}),
    "context_parallel": (
        {"context_parallel": ((1, 1), (2, 1), (1, 2), (2, 2))},
        {"context_parallel": ((1, 1),)},
    ),
    # those drawn for kvpool's own targets, as above (registry.RETENTIONS)
    "sparse_retention": ({"retentions": (None, None, 0, 1, 2)}, {"retentions": (None,)}),
    "connector_loads": ({"connector_loads": True}, {"connector_loads": False}),
    "eagle_flags": ({"eagle_flags": True}, {"eagle_flags": False}),
}
"""For each optional feature of the protocol (``request_codec.FEATURES``), the
``ManagerTargetSpec`` fields a program that announces it is checked with, and those of one
that does not (never sent the feature's calls or setup fields). A feature joins the
protocol here, in ``request_codec.FEATURES`` and in docs/formats.md."""

CMD_SCOPE: dict[str, Any] = {
    name: value for claimed, _ in FEATURE_SCOPES.values() for name, value in claimed.items()
}
"""The widest scope of a ``cmd:`` target (``resolve("request", "cmd:...")``): every optional
feature on, narrowed to what the program's hello announces (``declared_scope``)."""


def _known_profile(name: str) -> bool:
    try:
        profile_named(name)
    except InvalidConfig:
        return False
    return True


def _check_hello(hello: dict[str, Json]) -> dict[str, Json]:
    if hello.get("layer") != codec.LAYER:
        raise SessionFailure(
            f"the target answered hello for layer {hello.get('layer')!r:.100}, "
            f"not {codec.LAYER!r}: "
            "it speaks the pool's protocol, or another layer's (docs/formats.md)"
        )
    levels, profiles = hello.get("levels", [1]), hello.get("profiles", [DEFAULT_PROFILE.name])
    if not isinstance(levels, list) or not levels or not all(x in (1, 2) for x in levels):
        raise SessionFailure(f"hello: levels must be a list of 1 and/or 2, got {levels!r:.200}")
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise SessionFailure(
            f"hello: profiles must be a list of profile names, got {profiles!r:.200}"
        )
    unknown = [p for p in profiles if not _known_profile(str(p))]
    if unknown:
        raise SessionFailure(
            f"hello: unknown profile(s) {unknown!r:.200}; the profiles are {', '.join(PROFILES)}"
        )
    if not isinstance(hello.get("snapshot", False), bool):
        raise SessionFailure(f"hello: snapshot must be true or false, got {hello['snapshot']!r}")
    if hello.get("hasher", "none") not in codec.HASHERS:
        raise SessionFailure(
            f"hello: hasher must be one of {', '.join(codec.HASHERS)}, got {hello['hasher']!r}"
        )
    layouts = hello.get("layouts", list(LAYOUTS))
    known = (*LAYOUTS, *HYBRID_LAYOUTS)
    if not isinstance(layouts, list) or not layouts or not all(x in known for x in layouts):
        raise SessionFailure(
            f"hello: layouts must be a list of layout names ({', '.join(known)}), "
            f"got {layouts!r:.200}"
        )
    events = hello.get("events", [False, True])
    if not isinstance(events, list) or not events or not all(isinstance(e, bool) for e in events):
        raise SessionFailure(
            f"hello: events must be a list of true and/or false, got {events!r:.200}"
        )
    factors = hello.get("block_factors", [1, 2])
    if (
        not isinstance(factors, list)
        or not factors
        or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 1 for f in factors)
    ):
        raise SessionFailure(f"hello: block_factors must be integers >= 1, got {factors!r:.200}")
    if not isinstance(hello.get("fine_grained", False), bool):
        raise SessionFailure(
            f"hello: fine_grained must be true or false, got {hello['fine_grained']!r:.100}"
        )
    window = hello.get("min_window", 1)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 6:
        raise SessionFailure(
            f"hello: min_window must be an integer from 1 to 6, got {window!r:.200}"
        )
    features = hello.get("features", [])
    if (
        not isinstance(features, list)
        or len(features) > codec.MAX_FEATURES
        or not all(isinstance(f, str) and len(f) <= codec.MAX_FEATURE_NAME for f in features)
    ):
        raise SessionFailure(
            f"hello: features must be a list of at most {codec.MAX_FEATURES} names "
            f"(among {', '.join(codec.FEATURES)}), got {features!r:.200}"
        )
    # a feature asked only with another (codec.FEATURE_NEEDS): alone, never asked
    announced = {*features, *(("fine_grained",) if hello.get("fine_grained") else ())}
    for feature, needed in codec.FEATURE_NEEDS.items():
        if feature in announced and needed not in announced:
            raise SessionFailure(
                f"hello: feature {feature} needs {needed} (it is asked with {needed}'s "
                "calls); announce both or neither"
            )
    return hello


REQUEST_DIALECT = Dialect(
    version=codec.REQUEST_PROTOCOL_VERSION,
    check_hello=_check_hello,
    is_rejection=lambda name: codec.request_error_class(name) is not None,
    check_result=codec.check_result,
    # the kit names the features it can check, so a program may tell kits apart
    hello_args={"layer": codec.LAYER, "features": list(codec.FEATURES)},
    unchecked=frozenset({"hello", "new_manager"}),
    queries=QUERIES,
)
"""The request layer's dialect of the JSON-lines session."""


class CmdManagerFactory:
    """Builds manager targets backed by one program (``resolve("request", "cmd:...")``).

    >>> CmdManagerFactory.from_spec("cmd:node examples/node-manager/manager.js").argv
    ['node', 'examples/node-manager/manager.js']
    """

    def __init__(
        self, argv: Sequence[str], timeout: float | None = None, cwd: str | None = None
    ) -> None:
        self.session = Session(argv, REQUEST_DIALECT, timeout, cwd)
        self.argv = self.session.argv
        self.generation = 0

    @classmethod
    def from_spec(cls, spec: str, timeout: float | None = None) -> "CmdManagerFactory":
        """The factory for a ``cmd:PROGRAM ARGS`` target string (split like a shell)."""
        _, _, command = spec.partition(":")
        return cls(shlex.split(command), timeout)

    # What the target says it supports -----------------------------------------

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(self.session.hello_answer().get("levels") or (1,))

    @property
    def profiles(self) -> tuple[str, ...]:
        hello = self.session.hello_answer()
        return tuple(hello.get("profiles") or (DEFAULT_PROFILE.name,))

    @property
    def has_snapshot(self) -> bool:
        return bool(self.session.hello_answer().get("snapshot", False))

    @property
    def hasher_kind(self) -> str:
        """``none``, ``own`` (its own hash function) or ``kvpool`` (kvpool's), from hello."""
        return str(self.session.hello_answer().get("hasher", "none"))

    @property
    def has_hasher(self) -> bool:
        return self.hasher_kind != "none"

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        """The program's own hashes of ``request`` (outside any manager)."""
        value = self.request("block_hashes", codec.encode_args("block_hashes", request))
        result: Sequence[bytes] = codec.decode_result("block_hashes", value)
        return result

    def none_hash(self, seed: str) -> bytes:
        """The program's root hash for ``seed``."""
        value = self.request("none_hash", codec.encode_args("none_hash", seed))
        result: bytes = codec.decode_result("none_hash", value)
        return result

    def declared_scope(self) -> dict[str, Any]:
        """What the program's hello claims of the machine's space (``ManagerTargetSpec``
        fields); a field the hello leaves out is not there: everything is claimed."""
        hello = self.session.hello_answer()
        claimed: dict[str, Any] = {}
        for name in ("layouts", "events", "block_factors"):
            if name in hello:
                claimed[name] = tuple(hello[name])
        if "min_window" in hello:
            claimed["min_window"] = int(hello["min_window"])
        # every optional feature, on or off: a program is asked only what it announces
        for feature, (on, off) in FEATURE_SCOPES.items():
            claimed.update(on if feature in self.features else off)
        return claimed

    @property
    def features(self) -> frozenset[str]:
        """The optional features the program announces that the kit knows (hello's
        ``features``, and the ``fine_grained`` boolean of earlier programs)."""
        hello = self.session.hello_answer()
        announced = set(hello.get("features", ()))
        if hello.get("fine_grained", False):
            announced.add("fine_grained")
        return frozenset(announced & set(codec.FEATURES))

    @property
    def fine_grained(self) -> bool:
        """Whether the program answers vLLM 0.33's further calls (feature ``fine_grained``)."""
        return "fine_grained" in self.features

    @property
    def scheduler_calls(self) -> bool:
        """Whether the program answers the rest of vLLM 0.33's scheduler calls (feature
        ``scheduler_calls``; ``free_blocks`` among them)."""
        return "scheduler_calls" in self.features

    def preflight(self, level: int, profiles: Sequence[str]) -> None:
        """Start the program; raise TargetError if it cannot run ``level`` and ``profiles``."""
        if level not in self.levels:
            self.fail_now(
                f"the target does not support level {level}: its hello lists levels "
                f"{list(self.levels)}"
            )
        missing = [p for p in profiles if p not in self.profiles]
        if missing:
            self.fail_now(
                f"the target does not implement profile(s) {missing}: its hello lists "
                f"{list(self.profiles)}"
            )

    # Building targets -----------------------------------------------------------

    def __call__(self, setup: ManagerSetup) -> "CmdManagerTarget":
        if setup.profile.name not in self.profiles:
            self.fail_now(
                f"new_manager asks for profile {setup.profile.name!r}, which the target does not "
                f"implement (its hello lists {list(self.profiles)})"
            )
        self.generation += 1
        self.session.recent.clear()
        self.session.last = None
        args = codec.encode_setup(setup)
        try:
            self.request("new_manager", args)
        except PoolError as rejection:
            try:
                _model_manager(setup)
            except PoolError:
                raise rejection from None
            self.fail_now(
                f"the target rejected new_manager with {type(rejection).__name__}, but the "
                "setup is valid"
            )
        cls: type[CmdManagerTarget] = CmdManagerTarget
        if self.has_snapshot and self.has_hasher:
            cls = SnapshotHashingCmdManagerTarget
        elif self.has_snapshot:
            cls = SnapshotCmdManagerTarget
        elif self.has_hasher:
            cls = HashingCmdManagerTarget
        return cls(self, setup, self.generation)

    def close(self) -> None:
        """Stop the program (closing its stdin first, so it can exit on its own)."""
        self.session.close()

    def fail_now(self, message: str) -> NoReturn:
        """Break the session with ``message`` and raise its TargetError."""
        self.session.fail_now(message)

    def request(self, op: str, args: dict[str, Json]) -> Json:
        """Send one request; the ``ok`` value, or the named rejection raised as the model's."""
        reply = self.session.request(op, args)
        if "error" in reply:
            cls = codec.request_error_class(reply["error"])
            assert cls is not None
            message = reply.get("message")
            raise cls(message if isinstance(message, str) else "rejected by the target")
        return reply["ok"]


def _model_manager(setup: ManagerSetup) -> KVCacheManagerState:
    return model_manager.new_kv_cache_manager(
        setup.num_blocks,
        setup.specs,
        setup.max_model_len,
        hash_block_size=setup.hash_block_size,
        enable_caching=setup.enable_caching,
        use_eagle=setup.use_eagle,
        log_stats=setup.log_stats,
        enable_events=setup.enable_events,
        profile=setup.profile,
        fine_grained_hits=setup.fine_grained_hits,
        max_in_flight_tokens=setup.max_in_flight_tokens,
        num_prefill_lookahead=setup.num_prefill_lookahead,
        eagle_groups=setup.eagle_groups,
        **geometry_arguments(setup),
        **retention_arguments(setup),
    )


class CmdManagerTarget:
    """One test case's manager inside the program (valid until the next ``new_manager``)."""

    def __init__(self, factory: CmdManagerFactory, setup: ManagerSetup, generation: int) -> None:
        self.factory = factory
        self.setup = setup
        self.generation = generation

    def __getattr__(self, name: str) -> Any:
        # vLLM 0.33's further calls, only for a program whose hello announces them: the
        # machine asks a target for the calls it has
        factory = self.__dict__.get("factory")
        if factory is not None and (
            (name in OPERATIONS_033 and factory.fine_grained)
            or (name in (*OPERATIONS_SCHEDULER, "free_blocks") and factory.scheduler_calls)
        ):
            return lambda *args: self._call(name, *args)
        raise AttributeError(name)

    def _call(self, op: str, *args: Any) -> Any:
        if self.generation != self.factory.generation:
            raise RuntimeError("this target was replaced by a later new_manager")
        value = self.factory.request(op, codec.encode_args(op, *args))
        return codec.decode_result(op, value)

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        result: tuple[Blocks, int] = self._call("get_computed_blocks", request)
        return result

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> Blocks | None:
        if full_sequence_must_fit and not self.factory.scheduler_calls:
            raise RuntimeError("full_sequence_must_fit asked of a program that did not announce it")
        loads = num_external_computed_tokens or reserved_blocks or skip_zeroing_group_ids
        if loads and "connector_loads" not in self.factory.features:
            raise RuntimeError(
                "a KV connector's loads asked of a program that did not announce them"
            )
        result: Blocks | None = self._call(
            "allocate_slots",
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            num_external_computed_tokens,
            reserved_blocks,
            tuple(skip_zeroing_group_ids),
        )
        return result

    def free(self, request: Request) -> None:
        self._call("free", request)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._call("cache_blocks", request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._call("evict_blocks", block_ids)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int] | None:
        result: Sequence[int] | None = self._call("get_num_common_prefix_blocks", request_id)
        return result

    def get_block_ids(self, request_id: str) -> Blocks:
        result: Blocks = self._call("get_block_ids", request_id)
        return result

    def take_events(self) -> Sequence[KVCacheEvent]:
        result: Sequence[KVCacheEvent] = self._call("take_events")
        return result

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        result: PrefixCacheStats | None = self._call("make_prefix_cache_stats")
        return result

    def usage(self) -> float:
        return float(self._call("usage"))

    def num_free_blocks(self) -> int:
        return int(self._call("num_free_blocks"))


class SnapshotCmdManagerTarget(CmdManagerTarget):
    """A program whose hello says ``"snapshot": true``: the whole state is compared."""

    def snapshot(self) -> KVCacheManagerState:
        value = self._call("snapshot")
        try:
            return codec.decode_manager_state(value, self.setup)
        except ProtocolError as error:
            message = f"target error during snapshot: malformed state: {error}"
        self.factory.fail_now(message)


class HashingCmdManagerTarget(CmdManagerTarget):
    """A program whose hello says ``"hasher": true``: it hashes requests itself."""

    def block_hashes(self, request: Request) -> Sequence[bytes]:
        result: Sequence[bytes] = self._call("block_hashes", request)
        return result


class SnapshotHashingCmdManagerTarget(SnapshotCmdManagerTarget, HashingCmdManagerTarget):
    """Both: the whole state is compared, and the program's own hashes checked."""
