"""A request-layer target that misbehaves as ``sys.argv[1]`` says, on its third ``free``.

The model's KV cache manager over the request layer's protocol, with one fault:

* ``crash``: exits with code 3 after a line on stderr;
* ``hang``: stops answering;
* ``garbage``: prints a line that is not JSON;
* ``out_of_turn``: answers with another request's id;
* ``unknown_error``: answers with an error name that is no exception of the model's;
* ``bad_result``: answers ``allocate_slots`` with a string;
* ``wrong_ids``: answers ``allocate_slots`` with block ids shifted by one (a divergence);
* ``pool_hello``: answers hello as a block pool would (no layer);
* ``bad_hello``: claims level 3;
* ``rejects_setup``: rejects every new_manager.
"""

import json
import sys
import time
from collections import Counter
from typing import Any

from kvpool.specs.protocol.request_server import RequestServer
from kvpool.specs.request.model_target import ModelManagerTarget

MODE = sys.argv[1]


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any] | str:
    op = request["op"]
    if op == "hello" and MODE == "pool_hello":
        reply["ok"].pop("layer")
    if op == "hello" and MODE == "bad_hello":
        reply["ok"]["levels"] = [3]
    if op == "new_manager" and MODE == "rejects_setup":
        return {"id": request["id"], "error": "InvalidManagerConfig", "message": "no"}
    if op == "allocate_slots" and reply.get("ok") and MODE == "wrong_ids":
        reply["ok"] = [[b + 1 for b in group] for group in reply["ok"]]
    if op == "allocate_slots" and MODE == "bad_result":
        reply = {"id": request["id"], "ok": "three blocks"}
    if op != "free" or seen != 3:
        return reply
    if MODE == "crash":
        sys.stderr.write("manager.c:77: free: Assertion `table != NULL' failed.\n")
        sys.stderr.flush()
        sys.exit(3)
    if MODE == "hang":
        sys.stderr.write("waiting for a lock that never comes\n")
        sys.stderr.flush()
        time.sleep(3600)
    if MODE == "garbage":
        return "DEBUG freeing request {oops"
    if MODE == "out_of_turn":
        return {**reply, "id": request["id"] + 7}
    if MODE == "unknown_error":
        return {"id": request["id"], "error": "TypeError", "message": "table is undefined"}
    return reply


def main() -> None:
    # the features it announced before hello listed them, so its runs draw what they did
    server = RequestServer(
        ModelManagerTarget, name="misbehaving-manager", features=("fine_grained",)
    )
    seen: Counter[str] = Counter()
    for line in sys.stdin:
        request = json.loads(line)
        seen[request["op"]] += 1
        reply = misbehave(request, server.handle(request), seen[request["op"]])
        sys.stdout.write((reply if isinstance(reply, str) else json.dumps(reply)) + "\n")
        sys.stdout.flush()


main()
