"""Running a target program that speaks JSON lines: start it, exchange lines, report failures.

Shared by the ``cmd:`` pool targets (``kvpool.specs.targets.cmd.pool``) and
consumers (``kvpool.specs.targets.cmd.consumer``). POSIX only: it waits on
the program's stdout with ``select``.
"""

import contextlib
import json
import os
import select
import shlex
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import IO

from kvpool.specs.protocol.codec import Json

DEFAULT_TIMEOUT = 5.0
TIMEOUT_ENV = "KVPOOL_CMD_TIMEOUT"
MAX_LINE = 64 * 1024 * 1024
STDERR_LINES = 10


def default_timeout() -> float:
    """Seconds to wait for one answer: ``KVPOOL_CMD_TIMEOUT`` if set, else 5."""
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_TIMEOUT
    return value if value > 0 else DEFAULT_TIMEOUT


class Failure(Exception):
    """Internal: one exchange went wrong; the text is the whole report."""


class Process:
    """One running target program: write a line, read a line, with a deadline."""

    def __init__(self, argv: Sequence[str], cwd: str | None) -> None:
        self.argv = list(argv)
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115  (closed by _stop)
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                cwd=cwd,
                bufsize=0,
            )
        except OSError as error:
            self.stderr.close()
            raise Failure(
                f"cannot start the target program {shlex.join(self.argv)}: {error}"
            ) from None
        self.buffer = b""
        self._finalizer = weakref.finalize(self, _stop, self.popen, self.stderr)

    def send(self, line: bytes) -> None:
        stdin = self.popen.stdin
        assert stdin is not None
        stdin.write(line)
        stdin.flush()

    def receive(self, timeout: float) -> bytes | None:
        """The next line, or None on end of file; raise TimeoutError past ``timeout``."""
        stdout = self.popen.stdout
        assert stdout is not None
        fd = stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
            if len(self.buffer) > MAX_LINE:
                raise Failure(f"the target printed more than {MAX_LINE} bytes without a newline")
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def exit_code(self, wait: float) -> int | None:
        try:
            return self.popen.wait(wait)
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self) -> list[str]:
        try:
            self.stderr.seek(0)
            text = self.stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return []
        return text.splitlines()[-STDERR_LINES:]

    def stop(self) -> None:
        self._finalizer()


def _stop(popen: "subprocess.Popen[bytes]", stderr: IO[bytes]) -> None:
    if popen.poll() is None:
        try:
            if popen.stdin is not None:
                popen.stdin.close()
            popen.wait(1.0)
        except (OSError, subprocess.TimeoutExpired):
            popen.kill()
            popen.wait()
    for stream in (popen.stdin, popen.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    stderr.close()


def reply_problem(reply: Json, request_id: int) -> str | None:
    if not isinstance(reply, dict):
        return f"the target answered with {clip(json.dumps(reply).encode())}, not a JSON object"
    if "id" not in reply:
        return (
            f"the answer has no id (expected id {request_id}): {clip(json.dumps(reply).encode())}"
        )
    if reply["id"] != request_id:
        return (
            f"the target answered out of turn: expected id {request_id}, got id "
            f"{reply['id']!r}: {clip(json.dumps(reply).encode())}"
        )
    if ("ok" in reply) == ("error" in reply):
        return f"an answer has exactly one of ok and error: {clip(json.dumps(reply).encode())}"
    return None


def show(args: Json) -> str:
    text = json.dumps(args, separators=(", ", ": "))
    return text if len(text) <= 300 else text[:297] + "..."


def clip(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return repr(text if len(text) <= 200 else text[:197] + "...")


def signal_name(code: int) -> str:
    if code >= 0:
        return ""
    import signal

    try:
        return f" (killed by {signal.Signals(-code).name})"
    except ValueError:
        return " (killed by a signal)"
