"""Consumers with one mistake each, as router authors make them: the layer must catch them.

They test the *kit*: the acceptance criteria of the event layer are that a
consumer keeping a set instead of counts fails under ``multiset`` and passes
under ``last-copy``, and one that ignores ``AllBlocksCleared`` fails under both.
"""

import time
from collections.abc import Mapping, Sequence

from kvpool.model import AllBlocksCleared, BlockRemoved, BlockStored, HashKey, KVCacheEvent
from kvpool.specs.events.model_target import ReferenceConsumer, held_prefix
from kvpool.specs.events.target import ConsumerConfig, Query


class SetConsumer:
    """Keeps which (hash, group) keys were stored, not how many times (Dynamo's tree does)."""

    def __init__(self, config: ConsumerConfig) -> None:
        self.held: list[set[HashKey]] = [set() for _ in range(config.num_workers)]

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        held = self.held[worker]
        for event in events:
            if isinstance(event, BlockStored):
                held.update((h, event.group_idx) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update((h, event.group_idx) for h in event.block_hashes)
            else:
                held.clear()

    def scores(self, query: Query) -> Mapping[int, int]:
        return {w: held_prefix(dict.fromkeys(h, 1), query) for w, h in enumerate(self.held)}


class IgnoresCleared(ReferenceConsumer):
    """Logs AllBlocksCleared and does nothing (llm-d-kv-cache#626, aibrix#2385)."""

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        super().apply_events(worker, [e for e in events if not isinstance(e, AllBlocksCleared)])


class RejectsDuplicateStores(ReferenceConsumer):
    """Raises when a hash it holds is stored again."""

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    if self.entries[worker][(h, event.group_idx)] > 0:
                        raise ValueError(f"block {h.hex()} stored twice")
        super().apply_events(worker, events)


class AnswersNegativeScores(ReferenceConsumer):
    """Says -1 for "unknown" instead of 0."""

    def scores(self, query: Query) -> Mapping[int, int]:
        return {w: n or -1 for w, n in super().scores(query).items()}


class AnswersAList(ReferenceConsumer):
    def scores(self, query: Query) -> Mapping[int, int]:
        return list(super().scores(query).values())  # type: ignore[return-value]


class NamesUnknownWorkers(ReferenceConsumer):
    def scores(self, query: Query) -> Mapping[int, int]:
        return {**super().scores(query), 99: 0}


class HangsOnClear(ReferenceConsumer):
    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        if any(isinstance(e, AllBlocksCleared) for e in events):
            time.sleep(3600)
        super().apply_events(worker, events)
