"""A protocol server: any Python pool target, spoken over stdin and stdout.

The reference for implementers of the any-language protocol, and the way
the kit's own tests run Python pools as ``cmd:`` targets::

    python -m kvpool.specs.protocol impl    # kvpool.impl, spoken over stdin/stdout
"""

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
from kvpool.specs.protocol.serving import reply, serve_lines


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
        """The reply to one decoded request (``serving.reply``: rejections by name)."""
        return reply(message, self._answer, rejections=(PoolError,))

    def _answer(self, op: str, args: dict[str, Json]) -> Json:
        if op == "hello":
            probe = self.make_target(PoolConfig(2))
            return hello_result(self.name, snapshot=isinstance(probe, Snapshottable))
        if op == "new_pool":
            self.target = None
            self.target = self.make_target(decode_config(args))
            return None
        if self.target is None:
            raise ProtocolError(f"{op[:100]!r} before new_pool")
        return apply(self.target, op, args)


def serve(
    make_target: TargetFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer requests from ``stdin`` on ``stdout`` until stdin closes (``serving.serve_lines``)."""
    serve_lines(Server(make_target, name).handle, stdin, stdout)
