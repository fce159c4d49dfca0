"""A request-layer protocol server: any Python KV cache manager target over stdin and stdout.

The reference for implementers of the request layer's dialect, and the way
the kit's own tests run Python managers as ``cmd:`` targets::

    python -m kvpool.specs.protocol --layer request impl

Its hello announces the optional features (``request_codec.FEATURES``) the
target has, found by probing it (``probe_features``), or those it is told.
"""

import inspect
from collections.abc import Sequence
from typing import IO

from kvpool.model import PROFILES, PoolError
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.protocol.request_codec import (
    CONNECTOR_ARGUMENTS,
    FEATURE_NEEDS,
    FEATURES,
    LAYER,
    REQUEST_PROTOCOL_VERSION,
    apply,
    decode_setup,
)
from kvpool.specs.protocol.serving import reply, serve_lines
from kvpool.specs.request.target import (
    ManagerFactory,
    ManagerSetup,
    ManagerSnapshottable,
    ManagerTarget,
)


def request_hello_result(
    name: str,
    levels: Sequence[int] = (1, 2),
    profiles: Sequence[str] = tuple(PROFILES),
    snapshot: bool = True,
    hasher: str = "none",
    fine_grained: bool = False,
    features: Sequence[str] = (),
) -> dict[str, Json]:
    """What a request-layer target answers to ``hello`` (``fine_grained`` only when true:
    the target answers vLLM 0.33's further calls and takes ``fine_grained_hits``; the
    optional ``features`` only when there are some, so older answers keep their shape)."""
    return {
        "protocol": REQUEST_PROTOCOL_VERSION,
        "layer": LAYER,
        "name": name,
        "levels": list(levels),
        "profiles": list(profiles),
        "snapshot": snapshot,
        "hasher": hasher,
        **({"fine_grained": True} if fine_grained else {}),
        **({"features": list(features)} if features else {}),
    }


PROBES: dict[str, ManagerSetup] = {
    "prefill_lookahead": ManagerSetup(
        4, (full_attention(1),), 8, 1, use_eagle=True, num_prefill_lookahead=1
    ),
    "eagle_hybrids": ManagerSetup(
        4, (full_attention(1), sliding_window(1, 2)), 8, 1, use_eagle=True
    ),
    "context_parallel": ManagerSetup(
        4, (full_attention(1),), 8, 2, dcp_world_size=2, pcp_world_size=2
    ),
    "sparse_retention": ManagerSetup(4, (sliding_window(1, 2),), 8, 1, retention_interval=0),
    "eagle_flags": ManagerSetup(
        4, (full_attention(1), sliding_window(1, 2)), 8, 1, use_eagle=True, eagle_groups=(0,)
    ),
}
"""A setup that needs each feature a factory announces by taking it (``probe_features``)."""


def probe_features(make_target: ManagerFactory) -> tuple[str, ...]:
    """The optional features a Python manager factory has, in ``FEATURES``' order.

    Calls are features when its targets have the methods (``fine_grained``:
    ``take_kv_cache_block_copies``; ``scheduler_calls``: ``pop_blocks_for_free``;
    ``connector_loads``: with those, an ``allocate_slots`` taking ``CONNECTOR_ARGUMENTS``);
    setup fields are when the factory builds a setup that needs them
    (``PROBES``) instead of refusing it. A factory that takes such a setup and
    ignores the field is then checked on it, and diverges.
    """
    probe = make_target(ManagerSetup(2, (full_attention(1),), 4, 1))
    found = {
        # an adapter may have the methods and say its engine cannot (an earlier vLLM)
        "fine_grained": callable(getattr(probe, "take_kv_cache_block_copies", None))
        and bool(getattr(probe, "answers_033", True)),
        "scheduler_calls": callable(getattr(probe, "pop_blocks_for_free", None))
        and bool(getattr(probe, "answers_scheduler_calls", True)),
    }
    # a KV connector's loads are allocate_slots' further arguments, asked with the scheduler
    # calls only (kvpool.specs.request.machine.ConnectorLoadsMachine)
    found["connector_loads"] = _takes_connector_loads(probe)
    for feature, setup in PROBES.items():
        try:
            make_target(setup)
        except Exception:  # refused, by name or not: the factory does not take it
            found[feature] = False
        else:
            found[feature] = True
    for feature, needed in FEATURE_NEEDS.items():  # asked only with what it needs
        found[feature] = found.get(feature, False) and found.get(needed, False)
    return tuple(f for f in FEATURES if found.get(f, False))


def _takes_connector_loads(target: ManagerTarget) -> bool:
    """Whether ``target.allocate_slots`` takes a KV connector's arguments by name."""
    try:
        parameters = inspect.signature(target.allocate_slots).parameters
    except (TypeError, ValueError):  # no signature to read: not announced
        return False
    return all(name in parameters for name in CONNECTOR_ARGUMENTS)


class RequestServer:
    """Answers request-layer protocol messages with a Python manager target, one at a time."""

    def __init__(
        self,
        make_target: ManagerFactory,
        name: str = "python",
        features: Sequence[str] | None = None,
    ) -> None:
        """``features``: what hello announces (None: what ``probe_features`` finds)."""
        unknown = sorted(set(features or ()) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; known: {', '.join(FEATURES)}")
        self.make_target = make_target
        self.name = name
        self.features = None if features is None else tuple(features)
        self.target: ManagerTarget | None = None

    def handle(self, message: Json) -> dict[str, Json]:
        """The reply to one decoded request (``serving.reply``: rejections by name)."""
        return reply(message, self._answer, rejections=(PoolError,))

    def _answer(self, op: str, args: dict[str, Json]) -> Json:
        if op == "hello":
            probe = self.make_target(ManagerSetup(2, (full_attention(1),), 4, 1))
            hashes = callable(getattr(probe, "block_hashes", None))
            if self.features is None:
                self.features = probe_features(self.make_target)
            return request_hello_result(
                self.name,
                snapshot=isinstance(probe, ManagerSnapshottable),
                hasher=str(getattr(probe, "hash_function", "own")) if hashes else "none",
                # the boolean as before, for kits that predate hello's features
                fine_grained="fine_grained" in self.features,
                features=self.features,
            )
        if op == "new_manager":
            self.target = None
            self.target = self.make_target(decode_setup(args))
            return None
        if op == "none_hash":  # the hash chain's seed: needs no manager
            return apply(None, "none_hash", args)  # type: ignore[arg-type]
        if self.target is None:
            raise ProtocolError(f"{op[:100]!r} before new_manager")
        return apply(self.target, op, args)


def serve_requests(
    make_target: ManagerFactory,
    stdin: IO[str],
    stdout: IO[str],
    name: str = "python",
    features: Sequence[str] | None = None,
) -> None:
    """Answer request-layer requests from ``stdin`` on ``stdout`` until stdin closes
    (``serving.serve_lines``); hello announces ``features`` (None: those found)."""
    serve_lines(RequestServer(make_target, name, features).handle, stdin, stdout)
