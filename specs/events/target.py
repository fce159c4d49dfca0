"""The event layer's two protocols: a consumer of KV events, and an engine that produces them.

A KV-aware router folds each engine's events (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) into an index and asks it, for each
request, how many leading blocks each engine holds. The layer checks the
property "a router can rebuild the engine" from both sides:

* a **consumer** (``Consumer``) is checked against engines the kit trusts
  (the model's pool): after every batch of events its scores must equal what
  each engine would actually hit;
* an **engine** (``Engine``, the producer) is checked against the reference
  consumer (``kvpool.specs.events.model_target``): the fold of its stream
  must score every query as the engine's own lookups do.

Queries are about the main KV cache group (group 0): events of other groups
must not count. Every consumer is told the event semantics of the stream it
will see (``ConsumerConfig.event_semantics``); the ones it is correct for
are the ones it claims (an ``event_semantics`` attribute on its factory,
names of ``kvpool.model.EVENT_SEMANTICS``; without one it claims all).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvpool.model import EventSemantics, KVCacheEvent

OPERATIONS = ("apply_events", "scores", "remove_worker")
"""The consumer's operations; ``remove_worker`` is optional."""

ENGINE_OPERATIONS = (
    "serve",
    "extend",
    "finish",
    "evict",
    "reset_prefix_cache",
    "take_events",
    "cached_prefix",
)
"""The engine's operations, in the order a program uses them."""

MAIN_GROUP = 0
"""The KV cache group queries are about."""


@dataclass(frozen=True)
class ConsumerConfig:
    """What a consumer is built for; it never changes during a program."""

    num_workers: int
    """Engines are numbered 0 .. num_workers - 1."""
    block_size: int
    """Tokens per block, in every event and every query."""
    event_semantics: EventSemantics
    """The contract of the streams the consumer will see."""


@dataclass(frozen=True)
class Query:
    """A request a router scores: its tokens and the engines' hash of each full block.

    ``block_hashes[i]`` is the chained hash of the first ``(i + 1) * block_size``
    tokens, the value the engines' events carry for that block. A router
    that hashes tokens itself (Dynamo does) reads ``token_ids``.
    """

    token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


class Consumer(Protocol):
    """A KV-event consumer under test: an index a router keeps over its engines' events."""

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Fold one batch of ``worker``'s events, oldest first."""
        ...

    def scores(self, query: Query) -> Mapping[int, int]:
        """For each worker, how many leading blocks of ``query`` it is believed to hold.

        A worker left out scores 0.
        """
        ...


@runtime_checkable
class RemovesWorkers(Protocol):
    """A consumer that can forget an engine (it left, or restarted with an empty cache)."""

    def remove_worker(self, worker: int) -> None: ...


ConsumerFactory = Callable[[ConsumerConfig], Consumer]
"""Builds a fresh consumer for a configuration; called once per program."""


@dataclass(frozen=True)
class EngineConfig:
    """One simulated engine: a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int
    event_semantics: EventSemantics


class Engine(Protocol):
    """An engine that publishes KV events (a producer), driven like a serving engine.

    Requests are named by the handles ``serve`` returns. Whatever the engine
    is (a block pool, a radix cache), ``cached_prefix`` is its own answer to
    "how many leading blocks of this query would a request hit here".

    Optional: ``evict_held(request, position) -> block id`` evicts a block a
    running request holds (a failed KV load; the machine aims at it when the
    engine has it), ``tokens_of(request)`` the tokens a request has so far,
    ``snapshot() -> PoolState | None`` the whole state of a block pool,
    which holds the producer to ``event_stream_consistency`` too, and
    ``query(token_ids) -> Query`` for an engine whose events carry hashes of
    its own: the query with its hash of each full block (without it, blocks
    are hashed as ``kvpool.specs.events.engine.query_for`` does, the kit's
    hashes every pool adapter maps back to).
    """

    def serve(self, token_ids: Sequence[int]) -> int | None:
        """Admit a request with this prompt (whole blocks): hit, allocate, cache its blocks.

        Returns its handle, or None when the engine cannot schedule it now.
        """
        ...

    def extend(self, request: int, token_ids: Sequence[int]) -> bool:
        """A decode step that fills one more block of ``request``; False if there is no room."""
        ...

    def finish(self, request: int) -> None:
        """The request ends and frees its blocks (they stay cached until evicted)."""
        ...

    def evict(self, pick: int) -> int | None:
        """Drop one cached block from the cache (a KV connector's failed load does).

        ``pick`` chooses among the engine's blocks; returns the block's id, if it has one.
        """
        ...

    def reset_prefix_cache(self) -> bool:
        """Forget the whole cache if no request runs; whether it happened."""
        ...

    def take_events(self) -> Sequence[KVCacheEvent]:
        """The events published since the last call, oldest first."""
        ...

    def cached_prefix(self, query: Query) -> int:
        """How many leading blocks of ``query`` a request would hit in this engine now."""
        ...

    def running(self) -> Sequence[int]:
        """The handles of the requests that have not finished."""
        ...


EngineFactory = Callable[[EngineConfig], Engine]
"""Builds a fresh engine; called once per worker per program."""


def claimed_semantics(factory: object) -> tuple[str, ...]:
    """The event semantics a factory says its consumers (or engines) are correct for.

    >>> claimed_semantics(object())
    ('multiset', 'last-copy')
    """
    declared = getattr(factory, "event_semantics", None)
    if declared is None:
        return tuple(e.value for e in EventSemantics)
    return tuple(str(name) for name in declared)
