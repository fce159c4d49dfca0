"""A request-layer protocol server: any Python KV cache manager target over stdin and stdout.

The reference for implementers of the request layer's dialect, and the way
the kit's own tests run Python managers as ``cmd:`` targets::

    python -m kvpool.specs.protocol --layer request impl
"""

import json
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
) -> dict[str, Json]:
    """What a request-layer target answers to ``hello``."""
    return {
        "protocol": REQUEST_PROTOCOL_VERSION,
        "layer": LAYER,
        "name": name,
        "levels": list(levels),
        "profiles": list(profiles),
        "snapshot": snapshot,
        "hasher": hasher,
    }


class RequestServer:
    """Answers request-layer protocol messages with a Python manager target, one at a time."""

    def __init__(self, make_target: ManagerFactory, name: str = "python") -> None:
        self.make_target = make_target
        self.name = name
        self.target: ManagerTarget | None = None

    def handle(self, message: Json) -> dict[str, Json]:
        """The response to one decoded request."""
        request = message if isinstance(message, dict) else {}
        reply: dict[str, Json] = {"id": request.get("id")}
        op, args = request.get("op"), request.get("args") or {}
        try:
            if op == "hello":
                probe = self.make_target(ManagerSetup(2, (full_attention(1),), 4, 1))
                reply["ok"] = request_hello_result(
                    self.name,
                    snapshot=isinstance(probe, ManagerSnapshottable),
                    hasher=str(getattr(probe, "hash_function", "own"))
                    if callable(getattr(probe, "block_hashes", None))
                    else "none",
                )
            elif op == "new_manager":
                self.target = None
                self.target = self.make_target(decode_setup(args))
                reply["ok"] = None
            elif op == "none_hash":
                reply["ok"] = apply(None, "none_hash", args)  # type: ignore[arg-type]
            elif self.target is None:
                raise ProtocolError(f"{op!r} before new_manager")
            else:
                reply["ok"] = apply(self.target, str(op), args)
        except PoolError as error:
            reply["error"] = type(error).__name__
            reply["message"] = str(error)
        except ProtocolError as error:
            reply["error"] = "ProtocolError"
            reply["message"] = str(error)
        return reply


def serve_requests(
    make_target: ManagerFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer request-layer requests from ``stdin`` on ``stdout`` until stdin closes."""
    server = RequestServer(make_target, name)
    for line in stdin:
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        reply = server.handle(message)
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
