"""NVIDIA Dynamo's router index (``dynamo._core.RadixTree``, ai-dynamo-runtime 1.6.1) as a consumer.

The adapter turns the kit's events into the JSON ``RadixTree.apply_event``
reads and its ``find_matches`` answers into scores. Everything Dynamo's
vLLM integration does between vLLM's publisher and the tree is done here
the same way, in the adapter's own code (nothing of Dynamo's is copied;
docs/explanation/routers.md cites the sources, Dynamo release 1.6.1):

* **Hashes.** Dynamo keys a block by two u64 values: ``block_hash``, the
  engine's chained hash (in a vLLM deployment vLLM's own hash, read as an
  integer: ``lib/kv-router/src/zmq_wire/convert.rs``), and ``tokens_hash``,
  a hash of the block's tokens alone that labels the tree's edges and that
  queries are made of. The kit's hashes are opaque bytes, so ``block_hash``
  is their 64-bit BLAKE2b digest (one function for every worker, as the tree
  requires); ``tokens_hash`` is Dynamo's own ``compute_block_hash_for_seq``
  over the block's token ids, exactly what the converter and the router do.
* **Which events.** Only the main group (``group_idx`` 0), the GPU medium
  and blocks of the configured size reach the tree; a stored event naming
  one hash twice, or its own parent, becomes an empty removal
  (``convert.rs``).
* **Workers.** Worker ``w`` is Dynamo worker id ``w`` at dp rank 0; scores
  are read from the ``(w, 0)`` key.
* **Errors.** A ``RuntimeError`` from ``apply_event`` ("Failed to find
  block", "Failed to find parent block") is what a deployed router logs and
  goes past: it is counted (``describe``), not raised. A ``ValueError``
  means the adapter built bad JSON: a target error.

Two modes (``DynamoConsumerFactory(mode)``):

* ``deployed``: the publisher's duplicate filter (``EventDedupFilter``,
  ``lib/llm/src/kv_router/publisher/dedup.rs``, ai-dynamo/dynamo#8012) sits
  in front of the tree, as in a deployment: every stored hash is counted, a
  removal passes only when its count returns to zero (or it was never
  counted), ``cleared`` resets the counts. It claims the ``multiset``
  semantics of today's vLLM stream.
* ``raw``: every event goes straight to the tree, as the Python class is
  used on its own (and as deployments were before #8012). The tree keeps a
  set per worker, so it claims ``last-copy``.
"""

import hashlib
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool.model import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.specs.errors import TargetError
from kvpool.specs.events.target import MAIN_GROUP, ConsumerConfig, Query

RELEASE = "1.6.1"
"""The ai-dynamo-runtime release the adapter was written and checked against."""
PACKAGE = "ai-dynamo-runtime"
MODES = {"deployed": ("multiset",), "raw": ("last-copy",)}
"""Each mode and the event semantics it claims."""
DP_RANK = 0
U64 = (1 << 64) - 1


def load_dynamo() -> Any:
    """``dynamo._core``, or a TargetError saying how to install it."""
    # The tree logs a WARN line on stderr for every event it cannot apply,
    # which the adapter counts itself; the level is read when dynamo is imported.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        import dynamo._core as core  # type: ignore[import-not-found,unused-ignore]
    except Exception as error:  # ImportError, or the native library failing to load
        raise TargetError(
            f"Dynamo's router index cannot be imported ({error!r}): "
            f"pip install 'kvpool[dynamo]' (or {PACKAGE}=={RELEASE})"
        ) from error
    for name in ("RadixTree", "compute_block_hash_for_seq"):
        if not hasattr(core, name):
            raise TargetError(
                f"dynamo._core has no {name}: this adapter needs {PACKAGE}=={RELEASE}"
            )
    return core


def installed_version() -> str | None:
    """The installed ai-dynamo-runtime's version, or None."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def sequence_hash(block_hash: bytes) -> int:
    """The u64 ``block_hash`` Dynamo keys a block by, for one of the kit's hashes.

    >>> sequence_hash(b"\\x01") == sequence_hash(b"\\x01") != sequence_hash(b"\\x02")
    True
    """
    return int.from_bytes(hashlib.blake2b(block_hash, digest_size=8).digest(), "big")


class DedupFilter:
    """The publisher's duplicate filter, per worker: stores count, a removal passes at zero."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def stored(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.counts[h] += 1

    def removed(self, hashes: Sequence[int]) -> list[int]:
        """The hashes of a removal that pass on to the tree."""
        passing = []
        for h in hashes:
            if h not in self.counts:
                passing.append(h)  # never counted: passed on, as the filter does
                continue
            self.counts[h] -= 1
            if self.counts[h] <= 0:
                del self.counts[h]
                passing.append(h)
        return passing

    def cleared(self) -> None:
        self.counts.clear()


class DynamoConsumer:
    """One ``RadixTree`` for all workers, fed and asked as Dynamo's router does."""

    def __init__(self, config: ConsumerConfig, mode: str = "deployed") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: use {', '.join(MODES)}")
        core = load_dynamo()
        self.core = core
        self.config = config
        self.mode = mode
        self.tree = core.RadixTree()
        self.filters = [DedupFilter() for _ in range(config.num_workers)]
        self.event_ids = [0] * config.num_workers
        self.rejected: list[str] = []
        self.skipped: Counter[str] = Counter()

    # The consumer protocol ----------------------------------------------------

    def apply_events(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        for event in events:
            data = self._data(worker, event)
            if data is not None:
                self._apply(worker, data, event)

    def scores(self, query: Query) -> Mapping[int, int]:
        local = self.local_hashes(query.token_ids)
        if not local:
            return {}
        found = self.tree.find_matches(local, early_exit=False).scores
        return {w: int(found.get((w, DP_RANK), 0)) for w in range(self.config.num_workers)}

    def remove_worker(self, worker: int) -> None:
        self.tree.remove_worker(worker)
        self.filters[worker] = DedupFilter()

    def describe(self) -> str:
        """The tree's holdings per worker (from its own dump), and the events it refused."""
        held: dict[int, set[int]] = {}
        for line in self.tree.dump_tree_as_events():
            dumped = json.loads(line)
            stored = dumped["event"]["data"]["stored"]
            held.setdefault(dumped["worker_id"], set()).update(
                b["block_hash"] for b in stored["blocks"]
            )
        lines = [
            f"worker {w}: {len(held.get(w, ()))} block(s) in the tree"
            for w in range(self.config.num_workers)
        ]
        lines.extend(f"refused: {r}" for r in self.rejected[-10:])
        return "\n".join(lines)

    # Events to Dynamo's JSON --------------------------------------------------

    def local_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Dynamo's ``tokens_hash`` of each full block of ``token_ids``."""
        size = self.config.block_size
        full = len(token_ids) // size * size
        if full == 0:
            return []
        return [int(h) for h in self.core.compute_block_hash_for_seq(list(token_ids[:full]), size)]

    def _data(self, worker: int, event: KVCacheEvent) -> Any:
        """The ``data`` of the KvCacheEvent Dynamo would apply for ``event``, or None."""
        if isinstance(event, AllBlocksCleared):
            self.filters[worker].cleared()
            return "cleared"
        if event.group_idx != MAIN_GROUP or event.medium not in (None, MEDIUM_GPU):
            self.skipped["not the main group on the GPU"] += 1
            return None
        hashes = [sequence_hash(h) for h in event.block_hashes]
        if isinstance(event, BlockRemoved):
            if self.mode == "deployed":
                hashes = self.filters[worker].removed(hashes)
                if not hashes:
                    return None
            return {"removed": {"block_hashes": hashes}}
        assert isinstance(event, BlockStored)
        if event.block_size != self.config.block_size:
            self.skipped["another block size"] += 1
            return None
        parent = None if event.parent_block_hash is None else sequence_hash(event.parent_block_hash)
        if len(set(hashes)) != len(hashes) or parent in hashes:
            return {"removed": {"block_hashes": []}}
        local = self.local_hashes(event.token_ids)
        if self.mode == "deployed":
            self.filters[worker].stored(hashes)
        blocks = [{"block_hash": s, "tokens_hash": t} for s, t in zip(hashes, local, strict=False)]
        return {"stored": {"parent_hash": parent, "blocks": blocks}}

    def _apply(self, worker: int, data: Any, event: KVCacheEvent) -> None:
        raw = json.dumps({"event_id": self.event_ids[worker], "data": data, "dp_rank": DP_RANK})
        self.event_ids[worker] += 1
        try:
            self.tree.apply_event(worker, raw.encode())
        except RuntimeError as error:
            self.rejected.append(f"worker {worker}: {_show(event)}: {error}")
        except ValueError as error:
            raise TargetError(f"Dynamo cannot read the adapter's JSON {raw}: {error}") from error


def _show(event: KVCacheEvent) -> str:
    if isinstance(event, BlockStored):
        parent = "root" if event.parent_block_hash is None else event.parent_block_hash.hex()
        return f"stored {' '.join(h.hex() for h in event.block_hashes)} under {parent}"
    if isinstance(event, BlockRemoved):
        return f"removed {' '.join(h.hex() for h in event.block_hashes)}"
    return "cleared"


class DynamoConsumerFactory:
    """Builds ``DynamoConsumer``s in one mode; the registry's ``dynamo`` and ``dynamo:raw``."""

    def __init__(self, mode: str = "deployed") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown Dynamo mode {mode!r}: use {', '.join(MODES)}")
        self.mode = mode
        self.event_semantics = MODES[mode]

    def __call__(self, config: ConsumerConfig) -> DynamoConsumer:
        return DynamoConsumer(config, self.mode)

    def preflight(self, level: int, semantics: Sequence[str]) -> None:
        """Fail fast, before any program, when Dynamo cannot be imported."""
        load_dynamo()


def unavailable_reason() -> str | None:
    """Why Dynamo's index cannot be used here, or None if it can."""
    try:
        load_dynamo()
    except TargetError as error:
        return str(error)
    return None
