"""Reading what a manager with vLLM's ``KVCacheManager`` API returns, as the protocol's ids.

``kvpool.impl.KVCacheManager`` has that API, and so do vLLM's own manager and
its forks: both request-layer adapters read block objects and copy records
through these, as the pool adapters share ``block_pool_api``.
"""

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvpool.model.events import BlockStored, KVCacheEvent
from kvpool.model.manager import Blocks
from kvpool.model.single_type import AttentionType, KVCacheSpec


def block_ids(blocks: Any) -> Blocks:
    """The block ids of a ``KVCacheBlocks``, group by group."""
    return tuple(tuple(b.block_id for b in group) for group in blocks.blocks)


def copy_ids(
    copies: Iterable[Any], retained: Iterable[Any]
) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
    """``take_kv_cache_block_copies``' answer as ids: (source, destination) pairs, and the
    retained blocks the scheduler frees once the copies ran."""
    return (
        tuple((c.src_block_id, c.dst_block_id) for c in copies),
        tuple(b.block_id for b in retained),
    )


def group_annotation(specs: Sequence[KVCacheSpec], group: int) -> tuple[str, int | None]:
    """The spec kind and sliding window vLLM 0.33's ``KVCacheManager.take_events`` stamps on a
    ``BlockStored`` of ``group`` (kvpool's attention types are named as vLLM's kinds)."""
    spec = specs[group]
    window = spec.sliding_window if spec.attention is AttentionType.SLIDING_WINDOW else None
    return spec.attention.value, window


def without_annotation(event: KVCacheEvent, specs: Sequence[KVCacheSpec]) -> KVCacheEvent:
    """A manager's event as the protocol's (pool events): a ``BlockStored`` whose annotation is
    its group's spec loses it; one annotated otherwise, or not at all, keeps what it has, so
    it differs from the model's and the machine reports it."""
    if not isinstance(event, BlockStored) or not 0 <= event.group_idx < len(specs):
        return event
    stamped = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
    if stamped != group_annotation(specs, event.group_idx):
        return event
    return replace(event, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)


def offload_ids(offloads: Any) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """``take_boundary_state_offloads``' answer as plain ints: per request id, each
    (group, block id, boundary tokens), in the manager's order."""
    return {
        str(rid): tuple((int(g), int(b), int(n)) for g, b, n in entries)
        for rid, entries in offloads.items()
    }
