"""Answers the third free_blocks with the id of the request before it."""

from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "free_blocks" and seen == 3:
        return {**reply, "id": request["id"] - 1}
    return reply


run(misbehave)
