"""The consumer protocol: a KV-event consumer in any language, over JSON lines.

The kit writes one request per line on the program's stdin and reads one
response per line from its stdout, as for pool targets (``codec``,
docs/formats.md), with these operations:

=================  ==========================================  ===========================
op                 args                                        ok
=================  ==========================================  ===========================
``hello``          ``protocol`` (1), ``kit``, ``layer``        ``{"protocol": 1, "name",
                   (``"events"``)                              "event_semantics": [...],
                                                               "remove_worker": bool}``
``new_consumer``   ``num_workers``, ``block_size``,            ``null``
                   ``event_semantics``
``apply_events``   ``worker``, ``events`` (oldest first)       ``null``
``scores``         ``query``: ``{"token_ids", "block_hashes"}``  one integer per worker
``remove_worker``  ``worker``                                  ``null``
=================  ==========================================  ===========================

Events are the pool protocol's (``codec.encode_event``); a consumer has no
rejections, so any ``error`` answer is a target error. The JSON Schema is
``schemas/consumer-v1.json``. ``python -m kvpool.specs.protocol --consumer
model`` serves the reference consumer (or any ``module:factory``).
"""

from collections.abc import Mapping
from typing import IO

from kvpool.model import EVENT_SEMANTICS, EventSemantics
from kvpool.specs.events.target import (
    Consumer,
    ConsumerConfig,
    ConsumerFactory,
    Query,
    RemovesWorkers,
)
from kvpool.specs.protocol.codec import (
    Json,
    ProtocolError,
    decode_event,
    decode_hash,
    encode_hash,
)
from kvpool.specs.protocol.serving import reply, serve_lines

CONSUMER_PROTOCOL_VERSION = 1
MAX_WORKERS = 64
"""The most workers ``new_consumer`` asks for (the schema's bound)."""


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------


def encode_consumer_config(config: ConsumerConfig) -> dict[str, Json]:
    """The ``new_consumer`` arguments."""
    return {
        "num_workers": config.num_workers,
        "block_size": config.block_size,
        "event_semantics": config.event_semantics.value,
    }


def decode_consumer_config(value: Json) -> ConsumerConfig:
    """The inverse of ``encode_consumer_config``; bounded like the schema."""
    obj = _object(value, "new_consumer arguments")
    workers = _int(obj.get("num_workers"), "num_workers")
    block_size = _int(obj.get("block_size"), "block_size")
    semantics = obj.get("event_semantics")
    if not 1 <= workers <= MAX_WORKERS:
        raise ProtocolError(f"num_workers must be 1..{MAX_WORKERS}, got {workers}")
    if block_size < 1:
        raise ProtocolError(f"block_size must be positive, got {block_size}")
    if semantics not in EVENT_SEMANTICS:
        raise ProtocolError(f"event_semantics must be one of {list(EVENT_SEMANTICS)}")
    return ConsumerConfig(workers, block_size, EVENT_SEMANTICS[semantics])


def encode_query(query: Query) -> dict[str, Json]:
    """A query as JSON: its tokens and the hex hash of each full block."""
    return {
        "token_ids": list(query.token_ids),
        "block_hashes": [encode_hash(h) for h in query.block_hashes],
    }


def decode_query(value: Json) -> Query:
    """The inverse of ``encode_query``."""
    obj = _object(value, "query")
    tokens = _list(obj.get("token_ids"), "token_ids")
    hashes = _list(obj.get("block_hashes"), "block_hashes")
    return Query(tuple(_int(t, "token_ids") for t in tokens), tuple(decode_hash(h) for h in hashes))


def encode_scores(scores: Mapping[int, int], num_workers: int) -> list[int]:
    """Scores as one integer per worker (a worker left out scores 0)."""
    return [int(scores.get(w, 0)) for w in range(num_workers)]


def decode_scores(value: Json, num_workers: int) -> dict[int, int]:
    """One integer per worker back to a mapping; ProtocolError on any other shape."""
    scores = _list(value, "scores")
    if len(scores) != num_workers:
        raise ProtocolError(f"scores has {len(scores)} entries for {num_workers} workers")
    return {w: _int(s, "score") for w, s in enumerate(scores)}


# --------------------------------------------------------------------------
# A Python consumer served over stdin and stdout
# --------------------------------------------------------------------------


class ConsumerServer:
    """Answers consumer-protocol messages with a Python consumer, one at a time."""

    def __init__(self, make_consumer: ConsumerFactory, name: str = "python") -> None:
        self.make_consumer = make_consumer
        self.name = name
        self.consumer: Consumer | None = None
        self.config: ConsumerConfig | None = None

    def handle(self, message: Json) -> dict[str, Json]:
        """The reply to one decoded request (``serving.reply``)."""
        return reply(message, self._answer, served="consumer")

    def _answer(self, op: str, args: dict[str, Json]) -> Json:
        if op == "hello":
            declared = getattr(self.make_consumer, "event_semantics", None)
            semantics = list(EVENT_SEMANTICS) if declared is None else [str(s) for s in declared]
            probe = self.make_consumer(ConsumerConfig(1, 1, EventSemantics.MULTISET))
            return {
                "protocol": CONSUMER_PROTOCOL_VERSION,
                "name": self.name,
                "event_semantics": semantics,
                "remove_worker": isinstance(probe, RemovesWorkers),
            }
        if op == "new_consumer":
            self.consumer = None
            self.config = decode_consumer_config(args)
            self.consumer = self.make_consumer(self.config)
            return None
        if self.consumer is None or self.config is None:
            raise ProtocolError(f"{op!r} before new_consumer")
        obj = _object(args, "args")
        if op == "apply_events":
            worker = self._worker(obj)
            events = [decode_event(e) for e in _list(obj.get("events"), "events")]
            self.consumer.apply_events(worker, events)
            return None
        if op == "scores":
            scores = self.consumer.scores(decode_query(obj.get("query")))
            return encode_scores(scores, self.config.num_workers)
        if op == "remove_worker":
            remove = getattr(self.consumer, "remove_worker", None)
            if remove is None:
                raise ProtocolError("this consumer cannot remove a worker")
            remove(self._worker(obj))
            return None
        raise ProtocolError(f"unknown operation {op!r}")

    def _worker(self, obj: Mapping[str, Json]) -> int:
        assert self.config is not None
        worker = _int(obj.get("worker"), "worker")
        if not 0 <= worker < self.config.num_workers:
            raise ProtocolError(f"worker {worker} is not one of 0..{self.config.num_workers - 1}")
        return worker


def serve_consumer(
    make_consumer: ConsumerFactory, stdin: IO[str], stdout: IO[str], name: str = "python"
) -> None:
    """Answer requests from ``stdin`` on ``stdout`` until stdin closes (``serving.serve_lines``)."""
    serve_lines(ConsumerServer(make_consumer, name).handle, stdin, stdout)


# --------------------------------------------------------------------------
# Shape checks
# --------------------------------------------------------------------------


def _object(value: Json, what: str) -> dict[str, Json]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {value!r}")
    return value


def _list(value: Json, what: str) -> list[Json]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a JSON array, got {value!r}")
    return value


def _int(value: Json, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{what} must be an integer, got {value!r}")
    return value
