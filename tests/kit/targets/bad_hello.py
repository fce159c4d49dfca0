"""Its hello names a profile that does not exist (a typo of hashless-first)."""

from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "hello":
        reply["ok"]["profiles"] = ["hashles-first"]
    return reply


run(misbehave)
