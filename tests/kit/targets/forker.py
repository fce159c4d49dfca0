"""Forks a grandchild that outlives it unless its whole process group is ended.

``python forker.py PIDFILE MODE``: the grandchild writes its pid to PIDFILE and
sleeps; the target then serves the model (MODE ``serve``), hangs on the third
free_blocks (``hang``) or exits on it (``crash``).
"""

import os
import sys
import time
from typing import Any

from _serve import run

pidfile, mode = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    # The grandchild: no stdin/stdout of the kit's, just a long sleep.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(3600)
    os._exit(0)


def misbehave(request: dict[str, Any], reply: dict[str, Any], seen: int) -> dict[str, Any]:
    if request["op"] == "free_blocks" and seen == 3:
        if mode == "hang":
            time.sleep(3600)
        if mode == "crash":
            sys.exit(4)
    return reply


run(misbehave)
