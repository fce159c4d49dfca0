"""Answers the first get_new_blocks with an array nested 100 000 deep."""

import sys
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "get_new_blocks":
        nested = "[" * 100_000 + "]" * 100_000
        sys.stdout.write(f'{{"id": {request["id"]}, "ok": {nested}}}\n')
        sys.stdout.flush()
        return {"id": -1, "ok": None}  # never read: the kit has stopped
    return reply


run(misbehave)
