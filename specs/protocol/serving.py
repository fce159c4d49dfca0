"""What every protocol server shares: a request's envelope, the error replies, the read loop.

Each layer's server (pool, request layer, event consumer) answers only its own
operations; the envelope (``{"id", "op", "args"}``), the replies to malformed
requests and to a served target's crash, and the line-by-line loop over
bounded input are the same for all three, so they live here once.
"""

import json
from collections.abc import Callable
from typing import IO

from kvpool.specs.protocol.codec import Json, ProtocolError, read_requests

Answer = Callable[[str, dict[str, Json]], Json]
"""A server's own part: the ``ok`` value of one operation, given its name and args."""


def kind(value: Json) -> str:
    """The JSON kind of ``value``, as error messages name it."""
    return "null" if value is None else type(value).__name__


def protocol_error(request_id: Json, message: str) -> dict[str, Json]:
    """The reply to a request the protocol cannot accept."""
    return {"id": request_id, "error": "ProtocolError", "message": message}


def reply(
    message: Json,
    answer: Answer,
    rejections: tuple[type[Exception], ...] = (),
    served: str = "target",
) -> dict[str, Json]:
    """The reply to one decoded request; never raises for what the request holds.

    A malformed envelope is answered with ``"error": "ProtocolError"`` (and
    ``"id": null`` when the id itself is unusable). A rejection (one of
    ``rejections``, the layer's named errors) is answered with its class name
    and message; anything else the served ``served`` raises is answered with its
    class name too, which the kit reports as the target's error, not a rejection.
    """
    if not isinstance(message, dict):
        return protocol_error(None, f"a request is a JSON object, not {kind(message)}")
    request_id = message.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        return protocol_error(None, f"a request's id is an integer, not {kind(request_id)}")
    result: dict[str, Json] = {"id": request_id}
    op, args = message.get("op"), message.get("args", {})
    try:
        if not isinstance(op, str):
            raise ProtocolError(f"a request's op is a string, not {kind(op)}")
        if not isinstance(args, dict):
            raise ProtocolError(f"a request's args are a JSON object, not {kind(args)}")
        result["ok"] = answer(op, args)
    except ProtocolError as error:
        return protocol_error(request_id, str(error))
    except rejections as error:
        result["error"] = type(error).__name__
        result["message"] = str(error)
    except Exception as error:  # the served target's own crash: say what it raised
        result["error"] = type(error).__name__
        result["message"] = f"the {served} raised {type(error).__name__}: {error}"[:2000]
    return result


def serve_lines(handle: Callable[[Json], dict[str, Json]], stdin: IO[str], stdout: IO[str]) -> None:
    """Answer requests from ``stdin`` on ``stdout``, one line each, until stdin closes.

    Each line is read as bounded data (``codec.read_requests``): garbage is
    answered with a ProtocolError, and the server goes on with the next line.
    """
    for message in read_requests(stdin):
        if isinstance(message, ProtocolError):
            answer = protocol_error(None, str(message))
        else:
            answer = handle(message)
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()
