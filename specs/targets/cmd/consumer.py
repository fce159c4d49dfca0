"""``cmd:PROGRAM ARGS`` at the events layer: a KV-event consumer in any language, over JSON lines.

The exchange is ``kvpool.specs.protocol.consumer``'s (docs/formats.md). As
for pool programs (``kvpool.specs.targets.cmd.pool``) the kit starts the
program once and keeps it; each program of the machine begins with
``new_consumer``. A program that crashes, hangs, prints something that is
not an answer, answers out of turn, answers with an ``error`` (a consumer
has no rejections) or returns scores of the wrong shape is a target error,
and the target stays broken from then on. The exchange runs on the
layer-neutral ``Session`` (``kvpool.specs.targets.cmd.session``): answers
are bounded data, the program runs in a process group of its own and the
whole group is ended.
"""

import shlex
from collections.abc import Mapping, Sequence
from typing import NoReturn

from kvpool.model import EVENT_SEMANTICS, KVCacheEvent
from kvpool.specs.events.target import ConsumerConfig, Query
from kvpool.specs.protocol import codec
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.protocol.consumer import (
    CONSUMER_PROTOCOL_VERSION,
    decode_scores,
    encode_consumer_config,
    encode_query,
)
from kvpool.specs.targets.cmd.session import Dialect, Session, SessionFailure, clip


def _check_hello(hello: dict[str, Json]) -> dict[str, Json]:
    semantics = hello.get("event_semantics", [])
    if not isinstance(semantics, list) or any(s not in EVENT_SEMANTICS for s in semantics):
        raise SessionFailure(
            f"hello: event_semantics must list some of {list(EVENT_SEMANTICS)}, "
            f"got {clip(semantics)}"
        )
    if not isinstance(hello.get("remove_worker", False), bool):
        raise SessionFailure("hello: remove_worker must be true or false")
    return hello


def _check_result(op: str, value: Json) -> None:
    # Scores are checked against the consumer's worker count where they are read.
    if op in ("new_consumer", "apply_events", "remove_worker") and value is not None:
        raise ProtocolError(f"{op} answered {clip(value)}, not null")


CONSUMER_DIALECT = Dialect(
    version=CONSUMER_PROTOCOL_VERSION,
    check_hello=_check_hello,
    is_rejection=lambda name: False,
    check_result=_check_result,
    hello_args={"layer": "events"},
    unknown_error="a consumer has no rejections",
)
"""The consumer protocol (``kvpool.specs.protocol.consumer``) as a session dialect."""


class CmdConsumerFactory:
    """Builds consumers backed by one program; ``resolve("events", "cmd:...")`` returns one.

    >>> CmdConsumerFactory.from_spec("cmd:node consumer.js --fast").argv
    ['node', 'consumer.js', '--fast']
    """

    def __init__(
        self, argv: Sequence[str], timeout: float | None = None, cwd: str | None = None
    ) -> None:
        self.session = Session(argv, CONSUMER_DIALECT, timeout, cwd)
        self.generation = 0

    @classmethod
    def from_spec(cls, spec: str, timeout: float | None = None) -> "CmdConsumerFactory":
        """The factory for a ``cmd:PROGRAM ARGS`` string (split like a shell).

        ValueError if the string names no program or KVPOOL_CMD_TIMEOUT is unusable.
        """
        _, _, command = spec.partition(":")
        return cls(shlex.split(command), timeout)

    @property
    def argv(self) -> list[str]:
        return self.session.argv

    @property
    def timeout(self) -> float:
        return self.session.timeout

    @property
    def command(self) -> str:
        return self.session.command

    @property
    def event_semantics(self) -> tuple[str, ...]:
        """The event semantics the program's hello claims."""
        semantics = self.session.hello_answer().get("event_semantics") or []
        assert isinstance(semantics, list)
        return tuple(str(s) for s in semantics)

    @property
    def removes_workers(self) -> bool:
        return bool(self.session.hello_answer().get("remove_worker", False))

    def preflight(self, level: int, semantics: Sequence[str]) -> None:
        """Start the program and read its hello; TargetError if it cannot be checked."""
        self.session.hello_answer()

    def __call__(self, config: ConsumerConfig) -> "CmdConsumer":
        self.generation += 1
        self.session.recent.clear()
        self.request("new_consumer", encode_consumer_config(config))
        cls = RemovingCmdConsumer if self.removes_workers else CmdConsumer
        return cls(self, config, self.generation)

    def close(self) -> None:
        """End the program and its process group."""
        self.session.close()

    def request(self, op: str, args: dict[str, Json]) -> Json:
        """Send one request and return its ``ok`` value; TargetError (or Abort) otherwise."""
        return self.session.request(op, args)["ok"]

    def fail(self, message: str) -> NoReturn:
        """Mark the program broken with ``message`` and raise it."""
        self.session.fail_now(message)


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
        assert answer is None  # the dialect checked it

    def scores(self, query: Query) -> Mapping[int, int]:
        answer = self._request("scores", {"query": encode_query(query)})
        try:
            return decode_scores(answer, self.config.num_workers)
        except ProtocolError as error:
            self.factory.fail(f"scores answered {clip(answer)}: {error}")


class RemovingCmdConsumer(CmdConsumer):
    """A program whose hello says ``"remove_worker": true``."""

    def remove_worker(self, worker: int) -> None:
        self._request("remove_worker", {"worker": worker})
