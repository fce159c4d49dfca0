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
* ``bad_features``: hello's ``features`` is a string, not a list;
* ``ignores_retention``: builds its managers as if ``retention_interval`` were never set
  (caches densely);
* ``ignores_reserved``: allocates as if a KV connector's ``reserved_blocks`` were never set
  (admits what leaves fewer blocks free than reserved);
* ``ignores_eagle_flags``: builds its managers as if ``eagle_groups`` were never set (EAGLE
  on every group);
* ``bad_loads_answer``: answers an ``allocate_slots`` carrying a KV connector's loads with
  a block id that is a string;
* ``connector_alone``: announces ``connector_loads`` without ``scheduler_calls``.
"""

import json
import sys
from typing import Any

from kvpool.specs.protocol.request_server import RequestServer
from kvpool.specs.targets.impl.request import ImplManagerTarget

MODE, LOG = sys.argv[1], sys.argv[2]


def misbehave(request: dict[str, Any], server: RequestServer) -> dict[str, Any]:
    op = request["op"]
    args = request["args"]
    if op == "allocate_slots" and MODE == "ignores_whole":
        args.pop("full_sequence_must_fit", None)
    if op == "allocate_slots" and MODE == "ignores_reserved":
        args.pop("reserved_blocks", None)
    if op == "new_manager" and MODE == "ignores_retention":
        args.pop("retention_interval", None)
    if op == "new_manager" and MODE == "ignores_eagle_flags":
        args.pop("eagle_groups", None)
    reply = server.handle(request)
    if op == "hello" and MODE == "bad_features":
        reply["ok"]["features"] = "all"
    if op == "hello" and MODE == "connector_alone":
        reply["ok"]["features"].remove("scheduler_calls")
    loads = "num_external_computed_tokens" in args or "reserved_blocks" in args
    if op == "allocate_slots" and MODE == "bad_loads_answer" and loads and reply.get("ok"):
        reply["ok"][0] = [str(b) for b in reply["ok"][0]] or ["0"]
    if op == "get_computed_blocks_for_connector" and "ok" in reply:
        if MODE == "connector_bug":
            reply["ok"]["blocks"] = [[] for _ in reply["ok"]["blocks"]]
            reply["ok"]["num_tokens"] = 0
        if MODE == "bad_connector_answer":
            del reply["ok"]["hit_diverged"]
    return reply


FOCUS = {
    "ignores_whole": ("scheduler_calls",),
    "ignores_reserved": ("scheduler_calls", "connector_loads"),
}
"""The features a planted bug's program announces: its own (and those it needs) only, so
that the kit finds the bug in seconds; the other modes announce every feature."""


def main() -> None:
    features = () if MODE == "old" else FOCUS.get(MODE)
    server = RequestServer(ImplManagerTarget, name=f"featured-{MODE}", features=features)
    with open(LOG, "a", encoding="utf-8") as log:
        for line in sys.stdin:
            request = json.loads(line)
            log.write(line if line.endswith("\n") else line + "\n")
            log.flush()
            sys.stdout.write(json.dumps(misbehave(request, server)) + "\n")
            sys.stdout.flush()


main()
