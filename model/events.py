"""KV cache events: what a pool tells the outside world about its hash map.

A KV-aware router rebuilds which hashes each engine holds from this stream
alone, so the stream must describe every insertion into and removal from the
hash map. The field names are vLLM's; the hash values are the pool's own
opaque ``bytes`` (vLLM converts them to ints on the wire, which is a matter of
the adapter, not of the semantics).
"""

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvpool.model.profiles import EventSemantics

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True)
class BlockStored:
    """Hashes were inserted into the map, one per stored block, in block order."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[object, ...] | None
    group_idx: int
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    """With a pool built with ``num_hash_lookahead_tokens`` L > 0: per stored block,
    the (up to) L tokens after it, which its hash also covers; None otherwise."""
    kv_cache_spec_kind: str | None = None
    """The stored blocks' group's attention type, as vLLM 0.33's ``KVCacheManager.take_events``
    stamps it (``AttentionType`` values are vLLM's kind names); None from a pool, which
    knows no groups' specs, and at the request layer's protocol, which compares pool events."""
    kv_cache_spec_sliding_window: int | None = None
    """The group's sliding window, stamped beside the kind (None unless a sliding window)."""


@dataclass(frozen=True)
class BlockRemoved:
    """One hash key stopped pointing at one block."""

    block_hashes: tuple[bytes, ...]
    medium: str | None
    group_idx: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole map was emptied by reset_prefix_cache."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def fold_events(
    events: Iterable[KVCacheEvent],
    semantics: EventSemantics = EventSemantics.MULTISET,
    start: Mapping[tuple[bytes, int], int] | None = None,
) -> Counter[tuple[bytes, int]]:
    """The (hash, group) entries a consumer rebuilds from ``events``, continuing from ``start``.

    This is what the stream *means*, the contract every consumer of it must
    keep. Under ``MULTISET`` each stored hash adds one entry and each removed
    hash takes one away, so two blocks under one key count 2 and need two
    removals. Under ``LAST_COPY`` a key is present (count 1) from its first
    store, however many blocks follow it, until one removal takes it away.
    ``AllBlocksCleared`` empties everything. A removal of a key the fold does
    not hold leaves a negative count, which no correct stream produces.
    ``start`` is not changed.

    >>> stored = BlockStored((b"a",), None, (1,), 1, None, MEDIUM_GPU, None, (None,), 0)
    >>> removed = BlockRemoved((b"a",), MEDIUM_GPU, 0)
    >>> dict(fold_events([stored, stored, removed]))
    {(b'a', 0): 1}
    >>> dict(+fold_events([stored, stored, removed], EventSemantics.LAST_COPY))
    {}
    """
    entries: Counter[tuple[bytes, int]] = Counter(start or {})
    per_copy = semantics is EventSemantics.MULTISET
    for event in events:
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                key = (block_hash, event.group_idx)
                entries[key] = entries[key] + 1 if per_copy else 1
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                key = (block_hash, event.group_idx)
                held = entries[key]
                entries[key] = held - 1 if per_copy or held <= 0 else 0
        elif isinstance(event, AllBlocksCleared):
            entries.clear()
    return entries
