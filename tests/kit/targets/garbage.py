"""Prints a line that is not JSON instead of answering the third free_blocks."""

import sys
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "free_blocks" and seen == 3:
        sys.stdout.write("DEBUG freeing blocks {oops\n")
        sys.stdout.flush()
    return reply


run(misbehave)
