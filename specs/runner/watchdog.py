"""A time limit on each program run against an in-process target.

A target that loops forever inside one operation would hang the whole
check (and the CI job around it) with no report. ``program_deadlines``
arms a POSIX interval timer; each program re-arms it when it starts, so
the limit applies to one program at a time. When it expires, the alarm
raises ``TargetAbort`` carrying a ``TargetHang`` from wherever the target
is looping; Hypothesis lets that ``BaseException`` through, and the
runners report it as a target error.

Programs take milliseconds, so the default limit only ever fires on a
hang. Where timers cannot be used (Windows, a thread other than the main
one) there is no limit.
"""

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from kvpool.specs.errors import TargetAbort, TargetHang

DEFAULT_PROGRAM_TIMEOUT = 60.0
"""Seconds one program may take before the target is declared hung."""


class Deadlines:
    """Re-arms the timer at the start of each program."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds

    def start_program(self) -> None:
        if self.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)


@contextmanager
def program_deadlines(seconds: float | None) -> Iterator[Deadlines]:
    """Within the block, ``start_program()`` gives each program ``seconds`` (None: no limit)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if seconds is None or not usable:
        yield Deadlines(None)
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TargetAbort(
            TargetHang(f"a program ran for more than {seconds:g} s: the target hangs or loops")
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield Deadlines(seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
