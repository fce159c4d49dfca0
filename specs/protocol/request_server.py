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
from kvpool.specs.protocol.codec import Json, ProtocolError, read_requests
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
    fine_grained: bool = False,
) -> dict[str, Json]:
    """What a request-layer target answers to ``hello`` (``fine_grained`` only when true:
    the target answers vLLM 0.33's further calls and takes ``fine_grained_hits``)."""
    return {
        **({"fine_grained": True} if fine_grained else {}),
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
        """The response to one decoded request; never raises for what the request holds.

        A malformed request is answered with ``"error": "ProtocolError"``; a
        target that raises something other than a rejection is answered with
        that exception's class name (which the kit reports as a target error).
        """
        request = message if isinstance(message, dict) else {}
        request_id = request.get("id")
        reply: dict[str, Json] = {
            "id": request_id
            if isinstance(request_id, int) and not isinstance(request_id, bool)
            else None
        }
        op, args = request.get("op"), request.get("args") or {}
        try:
            if not isinstance(message, dict):
                raise ProtocolError("a request is a JSON object")
            if reply["id"] is None:
                raise ProtocolError("a request's id is an integer")
            if not isinstance(op, str):
                raise ProtocolError("a request's op is a string")
            if not isinstance(args, dict):
                raise ProtocolError("a request's args are a JSON object")
            if op == "hello":
                probe = self.make_target(ManagerSetup(2, (full_attention(1),), 4, 1))
                reply["ok"] = request_hello_result(
                    self.name,
                    snapshot=isinstance(probe, ManagerSnapshottable),
                    hasher=str(getattr(probe, "hash_function", "own"))
                    if callable(getattr(probe, "block_hashes", None))
                    else "none",
                    fine_grained=callable(getattr(probe, "take_kv_cache_block_copies", None)),
                )
            elif op == "new_manager":
                self.target = None
                self.target = self.make_target(decode_setup(args))
                reply["ok"] = None
            elif op == "none_hash":
                reply["ok"] = apply(None, "none_hash", args)  # type: ignore[arg-type]
            elif self.target is None:
                raise ProtocolError(f"{op[:100]!r} before new_manager")
            else:
                reply["ok"] = apply(self.target, str(op), args)
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


def serve_requests(
    make_target: ManagerFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer request-layer requests from ``stdin`` on ``stdout`` until stdin closes.

    Each line is read as bounded data (``codec.read_requests``): garbage is
    answered with a ProtocolError, and the server goes on with the next line.
    """
    server = RequestServer(make_target, name)
    for message in read_requests(stdin):
        if isinstance(message, ProtocolError):
            reply: dict[str, Json] = {"id": None, "error": "ProtocolError", "message": str(message)}
        else:
            reply = server.handle(message)
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
