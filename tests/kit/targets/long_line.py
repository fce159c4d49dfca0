"""Answers the first get_new_blocks with a 40 MB line (a valid answer padded with spaces)."""

import sys
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "get_new_blocks":
        sys.stdout.write(" " * (40 * 1024 * 1024))
    return reply


run(misbehave)
