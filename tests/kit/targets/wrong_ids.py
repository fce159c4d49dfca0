"""A divergence, not a crash: get_new_blocks answers with ids one too high.

It has no snapshot, so only the results can show the bug.
"""

from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "get_new_blocks" and isinstance(reply.get("ok"), list):
        return {**reply, "ok": [b + 1 for b in reply["ok"]]}
    return reply


run(misbehave, snapshot=False)
