"""Writes 64 MB to stderr when a pool is built, then crashes on the third free_blocks."""

import sys
from typing import Any

from _serve import run

CHUNK = ("x" * 1023 + "\n") * 1024


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "new_pool" and seen == 1:
        for _ in range(64):
            sys.stderr.write(CHUNK)
        sys.stderr.write("\x1b[31mthe last line, with a colour code\x1b[0m\n")
        sys.stderr.flush()
    if request["op"] == "free_blocks" and seen == 3:
        sys.exit(5)
    return reply


run(misbehave)
