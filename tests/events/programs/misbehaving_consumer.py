"""The reference consumer over the consumer protocol, misbehaving as argv[1] says.

crash: exits (code 4, a line on stderr) on the second apply_events;
garbage: prints a line that is not JSON for the first scores;
error: answers the first apply_events with an error;
short: answers scores with one integer too few;
hang: never answers the first scores.
"""

import json
import sys
import time

from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.protocol.consumer import ConsumerServer

mode = sys.argv[1]
server = ConsumerServer(ReferenceConsumer, name=f"misbehaving-{mode}")
seen: dict[str, int] = {}
for line in sys.stdin:
    request = json.loads(line)
    op = request["op"]
    seen[op] = seen.get(op, 0) + 1
    reply = server.handle(request)
    if mode == "crash" and op == "apply_events" and seen[op] == 2:
        sys.stderr.write("index.go:17: panic: nil map entry\n")
        sys.stderr.flush()
        sys.exit(4)
    if mode == "garbage" and op == "scores":
        sys.stdout.write("DEBUG scoring {oops\n")
        sys.stdout.flush()
        continue
    if mode == "error" and op == "apply_events":
        reply = {"id": reply["id"], "error": "KeyError", "message": "unknown block"}
    if mode == "short" and op == "scores":
        reply["ok"] = reply["ok"][:-1]
    if mode == "hang" and op == "scores":
        time.sleep(3600)
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
