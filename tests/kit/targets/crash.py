"""Crashes (exit code 3, a line on stderr) on the third free_blocks."""

import sys
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "free_blocks" and seen == 3:
        sys.stderr.write("pool.c:42: free_blocks: Assertion `block->ref_cnt > 0' failed.\n")
        sys.stderr.flush()
        sys.exit(3)
    return reply


run(misbehave)
