"""Stops answering (sleeps) on the third free_blocks."""

import sys
import time
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "free_blocks" and seen == 3:
        sys.stderr.write("waiting for a lock that never comes\n")
        sys.stderr.flush()
        time.sleep(3600)
    return reply


run(misbehave)
