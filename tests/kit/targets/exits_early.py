"""Exits with code 0 right after its hello, as a program that thinks it is done."""

import sys
from typing import Any

from _serve import run


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "new_pool":
        sys.exit(0)
    return reply


run(misbehave)
