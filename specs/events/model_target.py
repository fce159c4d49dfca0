"""The reference consumer: each worker's stream folded as the model says, scored by the fold.

It is the model of a router's index: the fold is ``kvpool.model.events.fold_events``
(the same one the pool invariant ``event_stream_consistency`` checks every
pool's stream with), under the event semantics the consumer is told. A
query scores, per worker, the leading blocks whose (hash, main group) entry
is held. docs/explanation/events.md says why the fold must count.
"""

from collections import Counter
from collections.abc import Mapping, Sequence

from kvpool.model import EventSemantics, HashKey, KVCacheEvent
from kvpool.model.events import fold_events
from kvpool.specs.events.target import MAIN_GROUP, ConsumerConfig, Query


class ReferenceConsumer:
    """Folds and scores exactly as the model says; correct for every event semantics."""

    event_semantics = tuple(e.value for e in EventSemantics)

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.entries: list[Counter[HashKey]] = [Counter() for _ in range(config.num_workers)]

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        self.entries[worker] = fold_events(
            events, self.config.event_semantics, self.entries[worker]
        )

    def scores(self, query: Query) -> Mapping[int, int]:
        return {w: held_prefix(entries, query) for w, entries in enumerate(self.entries)}

    def remove_worker(self, worker: int) -> None:
        self.entries[worker] = Counter()

    def describe(self) -> str:
        """What the fold holds per worker, one line each."""
        return "\n".join(
            f"worker {w}: {_entries_text(entries)}" for w, entries in enumerate(self.entries)
        )


def held_prefix(entries: Mapping[HashKey, int], query: Query) -> int:
    """How many leading blocks of ``query`` have a held main-group entry in ``entries``.

    >>> held_prefix({(b"a", 0): 2}, Query((1, 2), (b"a", b"ab")))
    1
    """
    hit = 0
    for block_hash in query.block_hashes:
        if entries.get((block_hash, MAIN_GROUP), 0) <= 0:
            break
        hit += 1
    return hit


def _entries_text(entries: Mapping[HashKey, int]) -> str:
    held = sorted((k, n) for k, n in entries.items() if n != 0)
    if not held:
        return "(nothing)"
    return ", ".join(
        f"{k[0].hex()}" + (f"/g{k[1]}" if k[1] != MAIN_GROUP else "") + (f" x{n}" if n != 1 else "")
        for k, n in held
    )
