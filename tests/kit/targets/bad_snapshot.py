"""Snapshots that break the protocol: ``missing-pending-events`` or ``unsorted-cached``."""

import sys
from typing import Any

from _serve import run

mode = sys.argv[1]


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "snapshot" and "ok" in reply:
        state = reply["ok"]
        if mode == "missing-pending-events":
            del state["pending_events"]
        elif mode == "unsorted-cached" and len(state["cached"]) >= 2:
            state["cached"].reverse()
    return reply


run(misbehave)
