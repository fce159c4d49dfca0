"""A JSON-lines session with one target program, whatever the layer.

The kit starts the program once per run (``process.TargetProcess``) and
keeps it: requests go out one per line, ``{"id": n, "op": ..., "args": ...}``,
and each answer must come back in turn, ``{"id": n, "ok": value}`` or
``{"id": n, "error": "ExceptionName", "message": ...}``. The first request
is ``hello``. docs/formats.md describes the exchange.

What is the layer's own comes in a ``Dialect``: what to say in ``hello``
and how to check the answer, which error names are rejections the layer
knows, the shape of each operation's result. A layer's adapter (the pool's
is ``kvpool.specs.targets.cmd.pool``) builds its targets on a ``Session``.

Every answer waits at most ``timeout`` seconds and is parsed as bounded
data (``kvpool.specs.protocol.codec.loads``). A program that cannot be
started, crashes, hangs, prints something that is not an answer, answers out
of turn or names an unknown error makes the session *broken*: the report
names the operation, what happened, the exit code, the last lines of its
stderr and the operations before it, the process group is ended, and every
further request raises the same ``TargetError`` at once. Inside a Hypothesis
test the error travels as ``TargetAbort``, so that Hypothesis does not try to
replay a program on a target that cannot be replayed.
"""

import json
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from hypothesis import currently_in_test_context

from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.protocol.codec import Json, ProtocolError, loads
from kvpool.specs.targets.cmd.process import (
    ProcessFailure,
    TargetProcess,
    parse_timeout,
)

DEFAULT_TIMEOUT = 5.0
TIMEOUT_ENV = "KVPOOL_CMD_TIMEOUT"
STARTUP_TIMEOUT = 20.0
"""Seconds the answer to ``hello`` may take at least: a program starting up (an
interpreter importing, ``cargo run`` building) is slower than one answering."""
RECENT_REQUESTS = 12
"""Operations before the failing one that a report lists."""


def default_timeout() -> float:
    """Seconds to wait for one answer: ``KVPOOL_CMD_TIMEOUT`` if set, else 5.

    Raises ValueError for a setting that is not a usable number of seconds
    (``inf``, ``nan``, 0, negative, words): the run stops before it starts.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    return parse_timeout(raw.strip(), TIMEOUT_ENV)


class SessionFailure(Exception):
    """One exchange went wrong; the text is the whole report."""


@dataclass(frozen=True)
class Dialect:
    """What a layer's protocol adds to the JSON-lines session."""

    version: int
    """The protocol version ``hello`` announces and expects back."""
    check_hello: Callable[[dict[str, Json]], dict[str, Json]]
    """Checks the ``ok`` value of the target's hello; raises SessionFailure if it is unusable."""
    is_rejection: Callable[[str], bool]
    """Whether an ``error`` name is one of the layer's rejections."""
    check_result: Callable[[str, Json], None]
    """Raises ProtocolError unless a value has the shape of the operation's result."""
    hello_args: dict[str, Json] = field(default_factory=dict)
    """What the kit says in hello besides the protocol version."""
    unchecked: frozenset[str] = frozenset({"hello"})
    """Operations whose ``ok`` value is not checked by ``check_result``."""
    queries: frozenset[str] = field(default_factory=frozenset)
    """The kit's own after-step questions: not listed among the operations before a failure."""
    unknown_error: str = "which is not an exception of kvpool.model.errors"
    """What a report says after an ``error`` name that is not a rejection of the layer."""


class Session:
    """One target program and its exchange, started on first use."""

    def __init__(
        self,
        argv: Sequence[str],
        dialect: Dialect,
        timeout: float | None = None,
        cwd: str | None = None,
    ) -> None:
        if not argv:
            raise ValueError("cmd: needs a program to run")
        self.argv = list(argv)
        self.dialect = dialect
        self.timeout = default_timeout() if timeout is None else timeout
        parse_timeout(str(self.timeout), "the timeout")
        self.cwd = cwd
        self.process: TargetProcess | None = None
        self.hello: dict[str, Json] | None = None
        self.broken: str | None = None
        self.next_id = 0
        self.recent: deque[str] = deque(maxlen=RECENT_REQUESTS)
        self.last: tuple[str, str] | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv) if self.process is None else self.process.command

    # --- what the target said about itself --------------------------------------

    def hello_answer(self) -> dict[str, Json]:
        """The target's answer to hello (starting it if needed); TargetError if it has none."""
        if self.hello is None:
            self.start()
        if self.hello is None:
            self.raise_broken()
        return self.hello

    def start(self) -> None:
        """Start the program and say hello, unless that happened (or failed) already."""
        if self.process is not None or self.broken is not None:
            return
        try:
            self.process = TargetProcess(self.argv, self.cwd)
            args = {"protocol": self.dialect.version, **self.dialect.hello_args, "kit": "kvpool"}
            reply = self._exchange("hello", args, starting=True)
            if "error" in reply:
                raise SessionFailure(
                    f"the target refused hello: {clip(str(reply.get('error')))} "
                    f"{clip(str(reply.get('message')))}"
                )
            hello = reply.get("ok")
            if not isinstance(hello, dict):
                raise SessionFailure(f"the target answered hello with {clip(hello)}, not an object")
            if hello.get("protocol") != self.dialect.version:
                raise SessionFailure(
                    f"the target speaks protocol version {_brief(hello.get('protocol'))}; "
                    f"this kit speaks {self.dialect.version}"
                )
            self.hello = self.dialect.check_hello(hello)
        except (SessionFailure, ProcessFailure) as failure:
            self.broken = str(failure)
            self.close()

    # --- the exchange -------------------------------------------------------------

    def request(self, op: str, args: dict[str, Json]) -> dict[str, Json]:
        """Send one request: the answer (``ok`` or a known rejection); TargetError otherwise."""
        reply: dict[str, Json] | None = None
        if self.broken is None:
            try:
                reply = self._exchange(op, args)
            except (SessionFailure, ProcessFailure) as failure:
                self.broken = str(failure)
                self.close()
        if reply is None:
            self.raise_broken()
        return reply

    def raise_broken(self) -> NoReturn:
        """Raise the session's TargetError (as TargetAbort inside a Hypothesis test)."""
        error = TargetError(self.broken or "the target is broken")
        if currently_in_test_context():
            raise TargetAbort(error)
        raise error

    def fail_now(self, message: str) -> NoReturn:
        """Break the session with ``message`` (unless broken already), end the program, raise."""
        if self.broken is None:
            self.broken = message
            self.close()
        self.raise_broken()

    def close(self) -> None:
        """End the program and its process group (closing its stdin first)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def _exchange(self, op: str, args: dict[str, Json], starting: bool = False) -> dict[str, Json]:
        if not starting:
            self.start()
            if self.broken is not None:
                raise SessionFailure(self.broken)
        process = self.process
        assert process is not None
        request_id = self.next_id
        self.next_id += 1
        line = json.dumps({"id": request_id, "op": op, "args": args}, separators=(",", ":"))
        what = f"{op} {show_args(args)}" if args else op
        if self.last is not None and self.last[0] not in self.dialect.queries:
            self.recent.append(self.last[1])
        self.last = (op, what)
        timeout = max(self.timeout, STARTUP_TIMEOUT) if starting else self.timeout
        try:
            process.send(line.encode() + b"\n")
            raw = process.receive(timeout)
        except TimeoutError:
            raise SessionFailure(
                self._report(
                    process,
                    what,
                    f"the target did not answer within {timeout:g} s (it hangs?); it was stopped",
                    alive=True,
                )
            ) from None
        except ProcessFailure as failure:
            raise SessionFailure(self._report(process, what, str(failure), alive=True)) from None
        except OSError as error:
            raise SessionFailure(
                self._report(process, what, f"the target stopped reading its input ({error})")
            ) from None
        if raw is None:
            raise SessionFailure(
                self._report(process, what, "the target closed its output (crashed?)")
            )
        try:
            reply = loads(raw)
        except ProtocolError as error:
            garbage = (
                f"the target printed something that is not a JSON answer ({error}): {clip(raw)}"
            )
            raise SessionFailure(self._report(process, what, garbage, alive=True)) from None
        problem = _reply_problem(reply, request_id)
        if problem is None:
            assert isinstance(reply, dict)
            problem = self._content_problem(op, reply)
        if problem is not None:
            raise SessionFailure(self._report(process, what, problem, alive=True))
        assert isinstance(reply, dict)
        return reply

    def _content_problem(self, op: str, reply: dict[str, Json]) -> str | None:
        if "error" in reply:
            name = reply["error"]
            if name == "ProtocolError":
                return f"the target could not read the request: {clip(reply.get('message'))}"
            if not isinstance(name, str) or not self.dialect.is_rejection(name):
                return (
                    f"the target answered with error {clip(name)}, {self.dialect.unknown_error} "
                    f"(message: {clip(reply.get('message'))})"
                )
            return None
        if op in self.dialect.unchecked:
            return None
        try:
            self.dialect.check_result(op, reply["ok"])
        except ProtocolError as error:
            return f"malformed result: {error}"
        return None

    def _report(self, process: TargetProcess, what: str, problem: str, alive: bool = False) -> str:
        lines = [f"target error during {what}: {problem}."]
        if alive:
            process.kill()
        code = process.exit_code(2.0)
        if not alive and code is not None:
            lines.append(f"exit code: {code}{_signal_name(code)}")
        tail = process.stderr_tail()
        if tail:
            lines.append("last lines of its stderr:")
            lines.extend(f"  {t}" for t in tail)
        else:
            lines.append("its stderr is empty.")
        earlier = list(self.recent)
        if earlier:
            lines.append("operations before it in this test case (oldest first):")
            lines.extend(f"  {r}" for r in earlier)
        lines.append(f"command: {process.command}")
        self.close()
        return "\n".join(lines)


def _reply_problem(reply: Json, request_id: int) -> str | None:
    if not isinstance(reply, dict):
        return f"the target answered with {clip(reply)}, not a JSON object"
    if "id" not in reply:
        return f"the answer has no id (expected id {request_id}): {clip(reply)}"
    if reply["id"] != request_id or isinstance(reply["id"], bool):
        return (
            f"the target answered out of turn: expected id {request_id}, got id "
            f"{clip(reply['id'])}: {clip(reply)}"
        )
    if ("ok" in reply) == ("error" in reply):
        return f"an answer has exactly one of ok and error: {clip(reply)}"
    return None


def show_args(args: Json) -> str:
    """Arguments as a report shows them (JSON, cut to 300 characters)."""
    text = json.dumps(args, separators=(", ", ": "))
    return text if len(text) <= 300 else text[:297] + "..."


def clip(value: object) -> str:
    """A value the target sent, as a report shows it: one line, at most 200 characters."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    shown = repr(text if len(text) <= 200 else text[:197] + "...")
    return shown


def _brief(value: Json) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _signal_name(code: int) -> str:
    if code >= 0:
        return ""
    import signal

    try:
        return f" (killed by {signal.Signals(-code).name})"
    except ValueError:
        return " (killed by a signal)"
