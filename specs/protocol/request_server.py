"""A request-layer protocol server: any Python KV cache manager target over stdin and stdout.

The reference for implementers of the request layer's dialect, and the way
the kit's own tests run Python managers as ``cmd:`` targets::

    python -m kvpool.specs.protocol --layer request impl
"""

from collections.abc import Sequence
from typing import IO

from kvpool.model import PROFILES, PoolError
from kvpool.model.single_type import full_attention
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.protocol.request_codec import (
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
) -> dict[str, Json]:
    """What a request-layer target answers to ``hello`` (``fine_grained`` only when true:
    the target answers vLLM 0.33's further calls and takes ``fine_grained_hits``)."""
    return {
        "protocol": REQUEST_PROTOCOL_VERSION,
        "layer": LAYER,
        "name": name,
        "levels": list(levels),
        "profiles": list(profiles),
        "snapshot": snapshot,
        "hasher": hasher,
        **({"fine_grained": True} if fine_grained else {}),
    }


class RequestServer:
    """Answers request-layer protocol messages with a Python manager target, one at a time."""

    def __init__(self, make_target: ManagerFactory, name: str = "python") -> None:
        self.make_target = make_target
        self.name = name
        self.target: ManagerTarget | None = None

    def handle(self, message: Json) -> dict[str, Json]:
        """The reply to one decoded request (``serving.reply``: rejections by name)."""
        return reply(message, self._answer, rejections=(PoolError,))

    def _answer(self, op: str, args: dict[str, Json]) -> Json:
        if op == "hello":
            probe = self.make_target(ManagerSetup(2, (full_attention(1),), 4, 1))
            hashes = callable(getattr(probe, "block_hashes", None))
            return request_hello_result(
                self.name,
                snapshot=isinstance(probe, ManagerSnapshottable),
                hasher=str(getattr(probe, "hash_function", "own")) if hashes else "none",
                fine_grained=callable(getattr(probe, "take_kv_cache_block_copies", None)),
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
    make_target: ManagerFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer request-layer requests from ``stdin`` on ``stdout`` until stdin closes
    (``serving.serve_lines``)."""
    serve_lines(RequestServer(make_target, name).handle, stdin, stdout)
