"""A JSON-lines session with one target program, for layers other than the pool (interim).

The seam between the request layer's ``cmd:`` adapter and the process
handling: ``Session`` and ``Dialect`` have the names and the methods of the
layer-neutral session being built for every layer (issue #20), and run on
the shared process code (``kvpool.specs.targets.cmd.process``, which the
pool and consumer adapters use) until it lands; then
``kvpool.specs.targets.cmd.request`` imports them from there and this
module goes.

The exchange is the pool's: one request per line, ``{"id": n, "op": ...,
"args": ...}``, each answered in turn with ``{"id": n, "ok": value}`` or
``{"id": n, "error": "ExceptionName", "message": ...}``; the first request
is ``hello``. A program that cannot start, crashes, hangs, prints something
that is not an answer, answers out of turn or names an unknown error breaks
the session: the report names the operation, what happened, the exit code,
the last lines of stderr and the operations before it; every further
request raises the same ``TargetError`` at once (``TargetAbort`` inside a
Hypothesis test).
"""

import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from hypothesis import currently_in_test_context

from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.targets.cmd.process import (
    Failure,
    Process,
    clip,
    default_timeout,
    reply_problem,
    show,
    signal_name,
)

RECENT_REQUESTS = 12
"""Operations before the failing one that a report lists."""


class SessionFailure(Failure):
    """One exchange went wrong; the text is the whole report."""


@dataclass(frozen=True)
class Dialect:
    """What a layer's protocol adds to the JSON-lines session."""

    version: int
    check_hello: Callable[[dict[str, Json]], dict[str, Json]]
    """Checks the target's hello answer; raises SessionFailure if it is unusable."""
    is_rejection: Callable[[str], bool]
    """Whether an ``error`` name is one of the layer's rejections."""
    check_result: Callable[[str, Json], None]
    """Raises ProtocolError unless a value has the shape of the operation's result."""
    hello_args: dict[str, Json] = field(default_factory=dict)
    """What the kit says in hello besides the protocol version."""
    unchecked: frozenset[str] = frozenset({"hello"})
    queries: frozenset[str] = field(default_factory=frozenset)
    """The kit's own after-step questions: not listed among the operations before a failure."""


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
        self.cwd = cwd
        self.process: Process | None = None
        self.hello: dict[str, Json] | None = None
        self.broken: str | None = None
        self.next_id = 0
        self.recent: deque[str] = deque(maxlen=RECENT_REQUESTS)
        self.last: tuple[str, str] | None = None

    @property
    def command(self) -> str:
        return " ".join(self.argv)

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
            self.process = Process(self.argv, self.cwd)
            args = {"protocol": self.dialect.version, **self.dialect.hello_args, "kit": "kvpool"}
            reply = self._exchange("hello", args, starting=True)
            if "error" in reply:
                raise SessionFailure(
                    f"the target refused hello: {reply.get('error')} {reply.get('message')}"
                )
            hello = reply.get("ok")
            if not isinstance(hello, dict):
                raise SessionFailure(f"the target answered hello with {hello!r}, not an object")
            if hello.get("protocol") != self.dialect.version:
                raise SessionFailure(
                    f"the target speaks protocol version {hello.get('protocol')!r}; "
                    f"this kit speaks {self.dialect.version}"
                )
            self.hello = self.dialect.check_hello(hello)
        except Failure as failure:
            self.broken = str(failure)
            self.close()

    def request(self, op: str, args: dict[str, Json]) -> dict[str, Json]:
        """Send one request: the answer (``ok`` or a known rejection); TargetError otherwise."""
        reply: dict[str, Json] | None = None
        if self.broken is None:
            try:
                reply = self._exchange(op, args)
            except Failure as failure:
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
        """End the program (closing its stdin first)."""
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
        what = f"{op} {show(args)}" if args else op
        if self.last is not None and self.last[0] not in self.dialect.queries:
            self.recent.append(self.last[1])
        self.last = (op, what)
        try:
            process.send(line.encode() + b"\n")
            raw = process.receive(self.timeout)
        except TimeoutError:
            raise SessionFailure(
                self._report(
                    process,
                    what,
                    f"the target did not answer within {self.timeout:g} s (it hangs?); "
                    "it was stopped",
                    alive=True,
                )
            ) from None
        except OSError as error:
            raise SessionFailure(
                self._report(process, what, f"the target stopped reading its input ({error})")
            ) from None
        except Failure as failure:
            raise SessionFailure(self._report(process, what, str(failure), alive=True)) from None
        if raw is None:
            raise SessionFailure(
                self._report(process, what, "the target closed its output (crashed?)")
            )
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):
            raise SessionFailure(
                self._report(
                    process,
                    what,
                    f"the target printed something that is not JSON: {clip(raw)}",
                    alive=True,
                )
            ) from None
        problem = reply_problem(reply, request_id)
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
                return f"the target could not read the request: {reply.get('message')}"
            if not isinstance(name, str) or not self.dialect.is_rejection(name):
                return (
                    f"the target answered with error {name!r}, which is not an exception "
                    f"of kvpool.model.errors (message: {reply.get('message')!r})"
                )
            return None
        if op in self.dialect.unchecked:
            return None
        try:
            self.dialect.check_result(op, reply["ok"])
        except ProtocolError as error:
            return f"malformed result: {error}"
        return None

    def _report(self, process: Process, what: str, problem: str, alive: bool = False) -> str:
        lines = [f"target error during {what}: {problem}."]
        if alive:
            process.popen.kill()
        code = process.exit_code(2.0)
        if not alive and code is not None:
            lines.append(f"exit code: {code}{signal_name(code)}")
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
        lines.append(f"command: {self.command}")
        self.close()
        return "\n".join(lines)
