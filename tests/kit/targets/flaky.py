"""Answers from hidden history: the 40th get_new_blocks of its life hands out a wrong id."""

from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "get_new_blocks" and seen == 40 and reply.get("ok"):
        reply["ok"] = [reply["ok"][0] + 1, *reply["ok"][1:]]
    return reply


run(misbehave)
