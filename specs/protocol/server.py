"""A protocol server: any Python pool target, spoken over stdin and stdout.

The reference for implementers of the any-language protocol, and the way
the kit's own tests run Python pools as ``cmd:`` targets::

    python -m kvpool.specs.protocol impl    # kvpool.impl, spoken over stdin/stdout
"""

import json
from collections.abc import Sequence
from typing import IO

from kvpool.model import PROFILES, PoolConfig, PoolError
from kvpool.specs.pool.target import PoolTarget, Snapshottable, TargetFactory
from kvpool.specs.protocol.codec import (
    PROTOCOL_VERSION,
    Json,
    ProtocolError,
    apply,
    decode_config,
)


def hello_result(
    name: str,
    levels: Sequence[int] = (1, 2),
    profiles: Sequence[str] = tuple(PROFILES),
    snapshot: bool = True,
) -> dict[str, Json]:
    """What a target answers to ``hello``."""
    return {
        "protocol": PROTOCOL_VERSION,
        "name": name,
        "levels": list(levels),
        "profiles": list(profiles),
        "snapshot": snapshot,
    }


class Server:
    """Answers protocol messages with a Python target, one pool at a time."""

    def __init__(self, make_target: TargetFactory, name: str = "python") -> None:
        self.make_target = make_target
        self.name = name
        self.target: PoolTarget | None = None

    def handle(self, message: Json) -> dict[str, Json]:
        """The response to one decoded request."""
        request = message if isinstance(message, dict) else {}
        reply: dict[str, Json] = {"id": request.get("id")}
        op, args = request.get("op"), request.get("args") or {}
        try:
            if op == "hello":
                probe = self.make_target(PoolConfig(2))
                reply["ok"] = hello_result(self.name, snapshot=isinstance(probe, Snapshottable))
            elif op == "new_pool":
                self.target = None
                self.target = self.make_target(decode_config(args))
                reply["ok"] = None
            elif self.target is None:
                raise ProtocolError(f"{op!r} before new_pool")
            else:
                reply["ok"] = apply(self.target, str(op), args)
        except PoolError as error:
            reply["error"] = type(error).__name__
            reply["message"] = str(error)
        except ProtocolError as error:
            reply["error"] = "ProtocolError"
            reply["message"] = str(error)
        return reply


def serve(
    make_target: TargetFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer requests from ``stdin`` on ``stdout`` until stdin closes."""
    server = Server(make_target, name)
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
