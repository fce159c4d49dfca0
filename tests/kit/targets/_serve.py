"""Shared by the misbehaving targets: the model over the protocol, with a hook per request.

Each script calls ``run(misbehave)``; ``misbehave(request, reply, seen)`` gets
every request, the model's correct reply and how many requests of that
operation came so far (this one included), and returns the reply to send
(or does something worse).
"""

import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.protocol import Server

Misbehave = Callable[[dict[str, Any], dict[str, Any], int], dict[str, Any]]


def run(misbehave: Misbehave, snapshot: bool = True) -> None:
    server = Server(ModelTarget, name="misbehaving")
    seen: Counter[str] = Counter()
    for line in sys.stdin:
        request = json.loads(line)
        seen[request["op"]] += 1
        reply = server.handle(request)
        if request["op"] == "hello":
            reply["ok"]["snapshot"] = snapshot
        reply = misbehave(request, reply, seen[request["op"]])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
