"""kvpool's impl over the request layer's protocol, announcing its optional features, with
one fault as ``sys.argv[1]`` says; every request it gets is logged to ``sys.argv[2]``
(one JSON line each, the request object), so a test can see what it was asked.

* ``good``: no fault;
* ``old``: announces no feature (a program written before them);
* ``connector_bug``: answers ``get_computed_blocks_for_connector`` without its hit
  (no blocks, no tokens): the connector lookup is wrong;
* ``ignores_whole``: allocates as if ``full_sequence_must_fit`` were never set (admission
  ignores it);
* ``bad_connector_answer``: answers ``get_computed_blocks_for_connector`` without
  ``hit_diverged``;
* ``bad_features``: hello's ``features`` is a string, not a list.
"""

import json
import sys
from typing import Any

from kvpool.specs.protocol.request_server import RequestServer
from kvpool.specs.targets.impl.request import ImplManagerTarget

MODE, LOG = sys.argv[1], sys.argv[2]


def misbehave(request: dict[str, Any], server: RequestServer) -> dict[str, Any]:
    op = request["op"]
    if op == "allocate_slots" and MODE == "ignores_whole":
        request["args"].pop("full_sequence_must_fit", None)
    reply = server.handle(request)
    if op == "hello" and MODE == "bad_features":
        reply["ok"]["features"] = "all"
    if op == "get_computed_blocks_for_connector" and "ok" in reply:
        if MODE == "connector_bug":
            reply["ok"]["blocks"] = [[] for _ in reply["ok"]["blocks"]]
            reply["ok"]["num_tokens"] = 0
        if MODE == "bad_connector_answer":
            del reply["ok"]["hit_diverged"]
    return reply


def main() -> None:
    server = RequestServer(
        ImplManagerTarget, name=f"featured-{MODE}", features=() if MODE == "old" else None
    )
    with open(LOG, "a", encoding="utf-8") as log:
        for line in sys.stdin:
            request = json.loads(line)
            log.write(line if line.endswith("\n") else line + "\n")
            log.flush()
            sys.stdout.write(json.dumps(misbehave(request, server)) + "\n")
            sys.stdout.flush()


main()
