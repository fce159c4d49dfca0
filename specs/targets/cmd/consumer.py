"""``cmd:PROGRAM ARGS`` at the events layer: a KV-event consumer in any language, over JSON lines.

The exchange is ``kvpool.specs.protocol.consumer``'s (docs/formats.md). As
for pool programs (``kvpool.specs.targets.cmd.pool``) the kit starts the
program once and keeps it; each program of the machine begins with
``new_consumer``. A program that crashes, hangs, prints something that is
not an answer, answers out of turn, answers with an ``error`` (a consumer
has no rejections) or returns scores of the wrong shape is a target error,
and the target stays broken from then on.
"""

import json
import shlex
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NoReturn

from hypothesis import currently_in_test_context

from kvpool.model import EVENT_SEMANTICS, KVCacheEvent
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.events.target import ConsumerConfig, Query
from kvpool.specs.protocol import codec
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.protocol.consumer import (
    CONSUMER_PROTOCOL_VERSION,
    decode_scores,
    encode_consumer_config,
    encode_query,
)
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


class CmdConsumerFactory:
    """Builds consumers backed by one program; ``resolve("events", "cmd:...")`` returns one.

    >>> CmdConsumerFactory.from_spec("cmd:node consumer.js --fast").argv
    ['node', 'consumer.js', '--fast']
    """

    def __init__(
        self, argv: Sequence[str], timeout: float | None = None, cwd: str | None = None
    ) -> None:
        if not argv:
            raise ValueError("cmd: needs a program to run")
        self.argv = list(argv)
        self.timeout = default_timeout() if timeout is None else timeout
        self.cwd = cwd
        self.process: Process | None = None
        self.hello: dict[str, Json] | None = None
        self.broken: str | None = None
        self.generation = 0
        self.next_id = 0
        self.recent: deque[str] = deque(maxlen=RECENT_REQUESTS)

    @classmethod
    def from_spec(cls, spec: str, timeout: float | None = None) -> "CmdConsumerFactory":
        """The factory for a ``cmd:PROGRAM ARGS`` string (split like a shell)."""
        _, _, command = spec.partition(":")
        return cls(shlex.split(command), timeout)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def event_semantics(self) -> tuple[str, ...]:
        """The event semantics the program's hello claims."""
        return tuple(self._hello().get("event_semantics") or ())

    @property
    def removes_workers(self) -> bool:
        return bool(self._hello().get("remove_worker", False))

    def preflight(self, level: int, semantics: Sequence[str]) -> None:
        """Start the program and read its hello; TargetError if it cannot be checked."""
        self._hello()

    def __call__(self, config: ConsumerConfig) -> "CmdConsumer":
        self.generation += 1
        self.recent.clear()
        self.request("new_consumer", encode_consumer_config(config))
        cls = RemovingCmdConsumer if self.removes_workers else CmdConsumer
        return cls(self, config, self.generation)

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    # The exchange -------------------------------------------------------------

    def request(self, op: str, args: dict[str, Json]) -> Json:
        """Send one request and return its ``ok`` value; TargetError (or Abort) otherwise."""
        if self.broken is None:
            try:
                return self._exchange(op, args)["ok"]
            except Failure as failure:
                self.broken = str(failure)
        self._raise_broken()

    def fail(self, message: str) -> NoReturn:
        """Mark the program broken with ``message`` and raise it."""
        if self.broken is None:
            self.broken = message
            self.close()
        self._raise_broken()

    def _raise_broken(self) -> NoReturn:
        error = TargetError(self.broken or "the consumer program is broken")
        if currently_in_test_context():
            raise TargetAbort(error)
        raise error

    def _hello(self) -> dict[str, Json]:
        if self.hello is None and self.broken is None:
            try:
                self.process = Process(self.argv, self.cwd)
                args = {"protocol": CONSUMER_PROTOCOL_VERSION, "kit": "kvpool", "layer": "events"}
                self.hello = _check_hello(self._exchange("hello", args, starting=True))
            except Failure as failure:
                self.broken = str(failure)
                self.close()
        if self.hello is None:
            self._raise_broken()
        return self.hello

    def _exchange(self, op: str, args: dict[str, Json], starting: bool = False) -> dict[str, Json]:
        if not starting:
            self._hello()
        process = self.process
        assert process is not None
        request_id = self.next_id
        self.next_id += 1
        what = f"{op} {show(args)}" if args else op
        line = json.dumps({"id": request_id, "op": op, "args": args}, separators=(",", ":"))
        try:
            process.send(line.encode() + b"\n")
            raw = process.receive(self.timeout)
        except TimeoutError:
            raise Failure(
                self._report(
                    what, f"it did not answer within {self.timeout:g} s (it hangs?)", alive=True
                )
            ) from None
        except OSError as error:
            raise Failure(self._report(what, f"it stopped reading its input ({error})")) from None
        if raw is None:
            raise Failure(self._report(what, "it closed its output (crashed?)"))
        try:
            reply = json.loads(raw)
        except ValueError:
            raise Failure(
                self._report(what, f"it printed something that is not JSON: {clip(raw)}", True)
            ) from None
        problem = reply_problem(reply, request_id)
        if problem is None and "error" in reply:
            problem = (
                f"it answered with error {reply.get('error')!r} "
                f"({reply.get('message')!r}); a consumer has no rejections"
            )
        if problem is not None:
            raise Failure(self._report(what, problem, alive=True))
        self.recent.append(what)
        assert isinstance(reply, dict)
        return reply

    def _report(self, what: str, problem: str, alive: bool = False) -> str:
        process = self.process
        lines = [f"target error during {what}: the consumer program failed: {problem}."]
        if process is not None:
            if alive:
                process.popen.kill()
            code = process.exit_code(2.0)
            if not alive and code is not None:
                lines.append(f"exit code: {code}{signal_name(code)}")
            tail = process.stderr_tail()
            lines.append("last lines of its stderr:" if tail else "its stderr is empty.")
            lines.extend(f"  {t}" for t in tail)
        if self.recent:
            lines.append("requests before it in this program (oldest first):")
            lines.extend(f"  {r}" for r in self.recent)
        lines.append(f"command: {self.command}")
        self.close()
        return "\n".join(lines)


class CmdConsumer:
    """One program's consumer (valid until the next ``new_consumer``)."""

    def __init__(self, factory: CmdConsumerFactory, config: ConsumerConfig, generation: int):
        self.factory = factory
        self.config = config
        self.generation = generation

    def _request(self, op: str, args: dict[str, Json]) -> Json:
        if self.generation != self.factory.generation:
            raise RuntimeError("this consumer was replaced by a later new_consumer")
        return self.factory.request(op, args)

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        answer = self._request(
            "apply_events", {"worker": worker, "events": [codec.encode_event(e) for e in events]}
        )
        if answer is not None:
            self.factory.fail(f"apply_events answered {answer!r}, not null")

    def scores(self, query: Query) -> Mapping[int, int]:
        answer = self._request("scores", {"query": encode_query(query)})
        try:
            return decode_scores(answer, self.config.num_workers)
        except ProtocolError as error:
            self.factory.fail(f"scores answered {clip(json.dumps(answer).encode())}: {error}")


class RemovingCmdConsumer(CmdConsumer):
    """A program whose hello says ``"remove_worker": true``."""

    def remove_worker(self, worker: int) -> None:
        self._request("remove_worker", {"worker": worker})


def _check_hello(reply: dict[str, Json]) -> dict[str, Json]:
    hello = reply.get("ok")
    if not isinstance(hello, dict):
        raise Failure(f"the consumer answered hello with {hello!r}, not an object")
    if hello.get("protocol") != CONSUMER_PROTOCOL_VERSION:
        raise Failure(
            f"the consumer speaks protocol version {hello.get('protocol')!r}; this kit speaks "
            f"{CONSUMER_PROTOCOL_VERSION}"
        )
    semantics = hello.get("event_semantics", [])
    if not isinstance(semantics, list) or any(s not in EVENT_SEMANTICS for s in semantics):
        raise Failure(
            f"hello: event_semantics must list some of {list(EVENT_SEMANTICS)}, got {semantics!r}"
        )
    if not isinstance(hello.get("remove_worker", False), bool):
        raise Failure("hello: remove_worker must be true or false")
    return hello
