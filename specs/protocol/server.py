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
    read_requests,
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
        """The response to one decoded request; never raises for what the request holds.

        A malformed request is answered with ``"error": "ProtocolError"``; a
        target that raises something other than a rejection is answered with
        that exception's class name (which the kit reports as a target error).
        """
        if not isinstance(message, dict):
            return _protocol_error(None, f"a request is a JSON object, not {_kind(message)}")
        request_id = message.get("id")
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            return _protocol_error(None, f"a request's id is an integer, not {_kind(request_id)}")
        reply: dict[str, Json] = {"id": request_id}
        op, args = message.get("op"), message.get("args", {})
        try:
            if not isinstance(op, str):
                raise ProtocolError(f"a request's op is a string, not {_kind(op)}")
            if not isinstance(args, dict):
                raise ProtocolError(f"a request's args are a JSON object, not {_kind(args)}")
            if op == "hello":
                probe = self.make_target(PoolConfig(2))
                reply["ok"] = hello_result(self.name, snapshot=isinstance(probe, Snapshottable))
            elif op == "new_pool":
                self.target = None
                self.target = self.make_target(decode_config(args))
                reply["ok"] = None
            elif self.target is None:
                raise ProtocolError(f"{op[:100]!r} before new_pool")
            else:
                reply["ok"] = apply(self.target, op, args)
        except PoolError as error:
            reply["error"] = type(error).__name__
            reply["message"] = str(error)
        except ProtocolError as error:
            reply["error"] = "ProtocolError"
            reply["message"] = str(error)
        except Exception as error:  # the served target's own crash: say what it raised
            reply["error"] = type(error).__name__
            reply["message"] = f"the target raised {type(error).__name__}: {error}"[:2000]
        return reply


def _kind(value: Json) -> str:
    return "null" if value is None else type(value).__name__


def _protocol_error(request_id: Json, message: str) -> dict[str, Json]:
    return {"id": request_id, "error": "ProtocolError", "message": message}


def serve(
    make_target: TargetFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer requests from ``stdin`` on ``stdout`` until stdin closes.

    Each line is read as bounded data (``codec.read_requests``): garbage is
    answered with a ProtocolError, and the server goes on with the next line.
    """
    server = Server(make_target, name)
    for message in read_requests(stdin):
        if isinstance(message, ProtocolError):
            reply = _protocol_error(None, str(message))
        else:
            reply = server.handle(message)
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
