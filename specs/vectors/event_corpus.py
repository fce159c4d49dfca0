"""The committed event-consumer corpus: scripted engine programs, recorded as consumer vectors.

Each scenario drives engines over the model's pool (``kvpool.specs.events.engine``)
and records every batch they publish and a few queries with what the engines
then hold. Each is recorded under both event semantics, so the pair pins what
the contract changes (same engines, same scores, other streams). ``known``
records the outcome each named consumer gives (measured with
ai-dynamo-runtime 1.6.1; CI replays the corpus and requires the same).
Deterministic: no clock, no Hypothesis. ``kvpool vectors export --layer
events DIR`` writes it; the copy in ``specs/vectors/event-data/`` is
committed and a test regenerates it.
"""

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kvpool.model import EVENT_SEMANTICS, EventSemantics
from kvpool.specs.events.engine import PoolEngine, pool_config, query_for
from kvpool.specs.events.machine import show_events
from kvpool.specs.events.target import MAIN_GROUP, EngineConfig
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.protocol import codec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.protocol.consumer import encode_query
from kvpool.specs.vectors.events import FORMAT, FORMAT_VERSION, GENERATOR, MANIFEST, dump_line
from kvpool.specs.vectors.format import sha256

GENERATOR_VERSION = 1
"""Bumped whenever the corpus changes."""


class EventScript:
    """Builds one vector: engines over the model act, their batches and queries are recorded."""

    def __init__(
        self,
        vector_id: str,
        description: str,
        tags: Sequence[str],
        semantics: EventSemantics,
        num_workers: int = 1,
        num_blocks: int = 6,
        block_size: int = 1,
    ) -> None:
        self.id = f"{vector_id}/{semantics.value}"
        self.description = description
        self.tags = [*tags, f"semantics:{semantics.value}"]
        self.semantics = semantics
        self.block_size = block_size
        config = EngineConfig(num_blocks, block_size, semantics)
        self.engines = [
            PoolEngine(ModelTarget(pool_config(config)), config) for _ in range(num_workers)
        ]
        self.steps: list[dict[str, Json]] = []
        self.known: dict[str, str] = {}

    def _publish(self, worker: int, comment: str) -> None:
        events = tuple(self.engines[worker].take_events())
        if events:
            self.steps.append(
                {
                    "op": "apply_events",
                    "worker": worker,
                    "events": [codec.encode_event(e) for e in events],
                    "comment": f"{comment}: {show_events(events)}",
                }
            )

    def serve(self, worker: int, tokens: Sequence[int]) -> int:
        handle = self.engines[worker].serve(tokens)
        assert handle is not None, f"{self.id}: no room to serve {tokens}"
        self._publish(worker, f"worker {worker} serves {list(tokens)}")
        return handle

    def extend(self, worker: int, request: int, tokens: Sequence[int]) -> None:
        assert self.engines[worker].extend(request, tokens), f"{self.id}: no room to extend"
        self._publish(worker, f"worker {worker}'s request {request} fills a block with {tokens}")

    def finish(self, worker: int, request: int) -> None:
        self.engines[worker].finish(request)
        self._publish(worker, f"worker {worker}'s request {request} finishes")

    def evict(self, worker: int, tokens: Sequence[int], copy: int = 0) -> None:
        """Evict the block caching the prefix ``tokens`` (the ``copy``-th one under its hash)."""
        engine = self.engines[worker]
        block_hash = query_for(tokens, self.block_size).block_hashes[-1]
        state = engine.pool.snapshot()  # type: ignore[attr-defined]
        block = state.cached[(block_hash, MAIN_GROUP)][copy]
        engine.pool.evict_blocks({block})
        self._publish(worker, f"worker {worker} evicts block {block}, which caches {list(tokens)}")

    def allocate(self, worker: int, tokens: Sequence[int]) -> int:
        """Serve ``tokens``, which needs free blocks: eviction by allocation pressure."""
        return self.serve(worker, tokens)

    def drain_and_reset(self, worker: int) -> None:
        engine = self.engines[worker]
        for request in list(engine.running()):
            engine.finish(request)
        assert engine.reset_prefix_cache()
        self._publish(worker, f"worker {worker} finishes every request and resets its cache")

    def restart(self, worker: int) -> None:
        config = self.engines[worker].config
        self.engines[worker] = PoolEngine(ModelTarget(pool_config(config)), config)
        self.steps.append(
            {
                "op": "remove_worker",
                "worker": worker,
                "comment": f"worker {worker} restarts with an empty cache",
            }
        )

    def query(self, tokens: Sequence[int], comment: str = "") -> None:
        query = query_for(tokens, self.block_size)
        step: dict[str, Json] = {
            "op": "scores",
            "query": encode_query(query),
            "expect": [e.cached_prefix(query) for e in self.engines],
        }
        if comment:
            step["comment"] = comment
        self.steps.append(step)

    def vector(self) -> dict[str, Json]:
        return {
            "id": self.id,
            "description": self.description,
            "tags": self.tags,
            "event_semantics": self.semantics.value,
            "config": {"num_workers": len(self.engines), "block_size": self.block_size},
            "steps": self.steps,
            "known": dict(sorted(self.known.items())),
        }


Scenario = Callable[[EventSemantics], Iterator[EventScript]]
SCENARIOS: list[Scenario] = []


def scenario(function: Scenario) -> Scenario:
    SCENARIOS.append(function)
    return function


def _known(script: EventScript, table: Mapping[str, Mapping[str, str]]) -> None:
    """Record, for this script's semantics, each consumer's outcome from ``table``."""
    for target, by_semantics in table.items():
        script.known[target] = by_semantics[script.semantics.value]


MATCH_ALL = {"model": {"multiset": "match", "last-copy": "match"}}


@scenario
def basics(semantics: EventSemantics) -> Iterator[EventScript]:
    s = EventScript(
        "basics/store-and-query",
        "a chain stored by one request: its prefixes hit, a query past it or beside it does not",
        ["basics"],
        semantics,
    )
    s.serve(0, [1, 2, 1])
    for tokens in ([1, 2, 1], [1, 2], [1], [2], [1, 2, 1, 1], [1, 1]):
        s.query(tokens)
    _known(s, {**MATCH_ALL, **_DYNAMO_MATCHES})
    yield s

    s = EventScript(
        "basics/two-workers",
        "two engines holding different prefixes of one chain are scored apart",
        ["basics", "workers"],
        semantics,
        num_workers=2,
    )
    s.serve(0, [1, 2])
    s.serve(1, [1, 2, 2])
    s.serve(1, [2])
    for tokens in ([1, 2, 2], [1, 2], [2], [2, 2]):
        s.query(tokens)
    _known(s, {**MATCH_ALL, **_DYNAMO_MATCHES})
    yield s


@scenario
def copies(semantics: EventSemantics) -> Iterator[EventScript]:
    s = EventScript(
        "copies/one-of-two-evicted",
        "a prompt of one block served twice is cached twice; evicting one copy leaves the "
        "prefix cached. multiset: one BlockRemoved; last-copy: none",
        ["copies", "duplicate-hashes"],
        semantics,
    )
    s.serve(0, [1])
    s.serve(0, [1])
    s.evict(0, [1])
    s.query([1], "the other copy still holds the prefix")
    _known(
        s,
        {
            **MATCH_ALL,
            "dynamo": {"multiset": "match", "last-copy": "match"},
            "dynamo:raw": {"multiset": "mismatch", "last-copy": "match"},
        },
    )
    yield s

    s = EventScript(
        "copies/both-evicted",
        "both copies of a prefix evicted one after the other: multiset publishes two "
        "removals, last-copy one; the prefix is gone either way",
        ["copies", "duplicate-hashes"],
        semantics,
    )
    s.serve(0, [1])
    s.serve(0, [1])
    s.evict(0, [1])
    s.query([1])
    s.evict(0, [1])
    s.query([1], "no copy is left")
    _known(
        s,
        {
            **MATCH_ALL,
            "dynamo": {"multiset": "match", "last-copy": "mismatch"},
            "dynamo:raw": {"multiset": "mismatch", "last-copy": "match"},
        },
    )
    yield s

    s = EventScript(
        "copies/last-block-recomputed",
        "a fully cached prompt recomputes its last block into a new block (vLLM computes at "
        "least one token): two copies of the last hash; allocation evicts the older one",
        ["copies", "duplicate-hashes", "eviction"],
        semantics,
        num_blocks=4,
    )
    first = s.serve(0, [1, 2])
    second = s.serve(0, [1, 2])
    s.finish(0, first)
    s.finish(0, second)
    s.query([1, 2])
    s.serve(0, [2])
    s.query([1, 2], "the recomputed copy of [1, 2] is still cached")
    s.query([2])
    _known(
        s,
        {
            **MATCH_ALL,
            "dynamo": {"multiset": "match", "last-copy": "match"},
            "dynamo:raw": {"multiset": "mismatch", "last-copy": "match"},
        },
    )
    yield s


@scenario
def cleared(semantics: EventSemantics) -> Iterator[EventScript]:
    s = EventScript(
        "cleared/reset-prefix-cache",
        "reset_prefix_cache publishes AllBlocksCleared: nothing of that worker is cached, "
        "the other worker keeps its prefix",
        ["cleared", "workers"],
        semantics,
        num_workers=2,
    )
    s.serve(0, [1, 2])
    s.serve(1, [1, 2])
    s.drain_and_reset(0)
    s.query([1, 2], "worker 0 holds nothing after the reset")
    s.serve(0, [2, 2])
    s.query([2, 2])
    s.query([1, 2])
    _known(s, {**MATCH_ALL, **_DYNAMO_MATCHES})
    yield s

    s = EventScript(
        "cleared/restart",
        "an engine restarts empty and the router forgets it (remove_worker)",
        ["workers", "remove-worker"],
        semantics,
        num_workers=2,
    )
    s.serve(0, [1])
    s.serve(1, [1])
    s.restart(1)
    s.query([1])
    s.serve(1, [2])
    s.query([2])
    _known(s, {**MATCH_ALL, **_DYNAMO_MATCHES})
    yield s


@scenario
def parents(semantics: EventSemantics) -> Iterator[EventScript]:
    s = EventScript(
        "parent/evicted-before-child-stored",
        "a running request's last block is evicted (a failed KV load), then the request "
        "fills its next block: the child is stored under a parent the engine no longer "
        "caches. Once the parent is cached again the engine hits both",
        ["parent", "finding"],
        semantics,
    )
    request = s.serve(0, [1])
    s.evict(0, [1])
    s.extend(0, request, [2])
    s.query([1, 2], "the parent is gone: nothing hits")
    s.serve(0, [1])
    s.query([1, 2], "the parent is cached again: the engine hits both blocks")
    _known(
        s,
        {
            **MATCH_ALL,
            "dynamo": {"multiset": "mismatch", "last-copy": "mismatch"},
            "dynamo:raw": {"multiset": "mismatch", "last-copy": "mismatch"},
        },
    )
    yield s


@scenario
def middle(semantics: EventSemantics) -> Iterator[EventScript]:
    s = EventScript(
        "middle/evicted-then-restored",
        "the middle block of a chain stored in one event is evicted and later cached again "
        "by a shorter prompt: the engine holds the whole chain again",
        ["middle", "finding"],
        semantics,
    )
    s.serve(0, [1, 2, 1])
    s.evict(0, [1, 2])
    s.query([1, 2, 1], "a gap: only the first block hits")
    s.serve(0, [1, 2])
    s.query([1, 2, 1], "the gap is filled: all three blocks hit")
    _known(
        s,
        {
            **MATCH_ALL,
            "dynamo": {"multiset": "mismatch", "last-copy": "mismatch"},
            "dynamo:raw": {"multiset": "mismatch", "last-copy": "mismatch"},
        },
    )
    yield s

    s = EventScript(
        "middle/evicted-then-restored-after-a-split",
        "the same, when another worker's chain branched off after the middle block first: "
        "the evicted block's descendants sit in a node of their own",
        ["middle", "workers"],
        semantics,
        num_workers=2,
    )
    s.serve(0, [1, 2, 1])
    s.serve(1, [1, 2, 2])
    s.evict(0, [1, 2])
    s.query([1, 2, 1])
    s.serve(0, [1, 2])
    s.query([1, 2, 1], "the gap is filled on worker 0")
    _known(s, {**MATCH_ALL, **_DYNAMO_MATCHES})
    yield s


_DYNAMO_MATCHES = {
    "dynamo": {"multiset": "match", "last-copy": "match"},
    "dynamo:raw": {"multiset": "match", "last-copy": "match"},
}


def generate() -> dict[str, list[dict[str, Json]]]:
    """The whole corpus, file name to vectors."""
    vectors = [
        script.vector()
        for make in SCENARIOS
        for semantics in EVENT_SEMANTICS.values()
        for script in make(semantics)
    ]
    return {"scenarios.jsonl": vectors}


def export(directory: Path) -> dict[str, Json]:
    """Write the corpus and its manifest into ``directory``; return the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    total = 0
    for name, vectors in generate().items():
        data = "".join(dump_line(v) + "\n" for v in vectors).encode()
        (directory / name).write_bytes(data)
        files.append({"name": name, "count": len(vectors), "sha256": sha256(data)})
        total += len(vectors)
    manifest: dict[str, Json] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "generator_version": GENERATOR_VERSION,
        "count": total,
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
