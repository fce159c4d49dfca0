"""One target program, whatever the layer: started in its own session, ended as a group.

``TargetProcess`` runs a program with pipes on stdin, stdout and stderr and
offers the two things a JSON-lines exchange needs: write a line, read a line
within a deadline. Everything the program sends is bounded:

* an answer line longer than ``MAX_LINE`` bytes is an error (``LineTooLong``),
  and reading is linear in what arrived (each byte is looked at once);
* stderr is drained by a thread into a tail of at most ``STDERR_TAIL`` bytes,
  so a program that writes gigabytes there costs the kit nothing.

The program is the leader of a new session (``setsid``), so it and every
process it starts (a shell, ``npm``, ``cargo run``, a fork) share one process
group. ``stop`` closes stdin, gives the program a moment to exit, then kills
the whole group; ``kill`` kills it at once. The group is also killed when the
object is collected or the interpreter exits. A descendant that starts a
session of its own leaves the group, and no kit can follow it.

POSIX only.
"""

import contextlib
import math
import os
import select
import shlex
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence

MAX_LINE = 16 * 1024 * 1024
"""Bytes one answer line may have (a whole pool snapshot is a few kilobytes)."""
STDERR_TAIL = 64 * 1024
"""Bytes of the program's stderr kept (the latest ones)."""
STDERR_LINES = 10
"""Lines of that tail a report shows."""
MAX_TIMEOUT = 24 * 3600.0
"""The longest wait for one answer a user may ask for, in seconds."""
GRACE = 1.0
"""Seconds a program has to exit on its own after its stdin closes."""


class ProcessFailure(Exception):
    """The program cannot be started, or sent something the kit does not accept."""


class LineTooLong(ProcessFailure):
    """An answer line longer than ``MAX_LINE`` bytes."""


def parse_timeout(text: str, source: str) -> float:
    """Seconds from a user's setting: a finite number above 0, at most ``MAX_TIMEOUT``.

    Raises ValueError naming ``source`` (where the text came from) otherwise.

    >>> parse_timeout("2.5", "KVPOOL_CMD_TIMEOUT")
    2.5
    >>> parse_timeout("inf", "KVPOOL_CMD_TIMEOUT")
    Traceback (most recent call last):
    ...
    ValueError: KVPOOL_CMD_TIMEOUT must be a number of seconds above 0 and at most 86400, not 'inf'
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise ValueError(
            f"{source} must be a number of seconds above 0 and at most {MAX_TIMEOUT:g}, "
            f"not {text!r}"
        )
    return value


class TargetProcess:
    """A running target program: write a line, read a line with a deadline, end its group."""

    def __init__(self, argv: Sequence[str], cwd: str | None = None, max_line: int = MAX_LINE):
        self.argv = list(argv)
        self.max_line = max_line
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                bufsize=0,
                start_new_session=True,
            )
        except (OSError, ValueError) as error:
            raise ProcessFailure(
                f"cannot start the target program {shlex.join(self.argv)}: {error}"
            ) from None
        self.pending = bytearray()
        self.scanned = 0
        """How much of ``pending`` is known to hold no newline."""
        self.tail = bytearray()
        self.tail_lock = threading.Lock()
        self.tail_reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self.tail_reader.start()
        self._finalizer = weakref.finalize(self, _end_group, self.popen, GRACE)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def send(self, line: bytes) -> None:
        """Write ``line`` (with its newline) to stdin; OSError if the program stopped reading."""
        stdin = self.popen.stdin
        assert stdin is not None
        stdin.write(line)
        stdin.flush()

    def receive(self, timeout: float) -> bytes | None:
        """The next line (without its newline), or None at end of output.

        Raises TimeoutError past ``timeout`` seconds and LineTooLong past ``max_line`` bytes.
        """
        stdout = self.popen.stdout
        assert stdout is not None
        fd = stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            end = self.pending.find(b"\n", self.scanned)
            if end >= 0:
                line = bytes(self.pending[:end])
                del self.pending[: end + 1]
                self.scanned = 0
                return line
            self.scanned = len(self.pending)
            if self.scanned > self.max_line:
                raise LineTooLong(
                    f"the target printed more than {self.max_line} bytes without a newline"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self.pending += chunk

    def _drain_stderr(self) -> None:
        stderr = self.popen.stderr
        assert stderr is not None
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(stderr.fileno(), 1 << 16):
                with self.tail_lock:
                    self.tail += chunk
                    if len(self.tail) > 2 * STDERR_TAIL:
                        del self.tail[:-STDERR_TAIL]

    def stderr_tail(self, lines: int = STDERR_LINES) -> list[str]:
        """The last ``lines`` lines of the program's stderr (what arrived so far)."""
        self.tail_reader.join(0.2)
        with self.tail_lock:
            text = bytes(self.tail[-STDERR_TAIL:]).decode("utf-8", "replace")
        shown = [_printable(line) for line in text.splitlines()[-lines:]]
        return [line if len(line) <= 300 else line[:297] + "..." for line in shown]

    def exit_code(self, wait: float) -> int | None:
        """The program's exit code, waiting up to ``wait`` seconds; None if it still runs."""
        try:
            return self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the program and every process of its group, now."""
        _kill_group(self.popen)

    def stop(self) -> None:
        """Close stdin, give the program ``GRACE`` seconds to exit, then end its whole group."""
        self._finalizer()


def _printable(line: str) -> str:
    return "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in line)


def _kill_group(popen: "subprocess.Popen[bytes]") -> None:
    # The leader is not reaped yet (a zombie at worst), so its id still names the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)


def _end_group(popen: "subprocess.Popen[bytes]", grace: float) -> None:
    """Let the leader exit on its own (stdin closed), then kill the group, then reap."""
    if popen.stdin is not None:
        with contextlib.suppress(OSError):
            popen.stdin.close()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not _exited(popen.pid):
        time.sleep(0.01)
    _kill_group(popen)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        popen.wait(5.0)
    for stream in (popen.stdout, popen.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _exited(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return found is not None
