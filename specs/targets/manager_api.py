"""Reading what a manager with vLLM's ``KVCacheManager`` API returns, as the protocol's ids.

``kvpool.impl.KVCacheManager`` has that API, and so do vLLM's own manager and
its forks: both request-layer adapters read block objects and copy records
through these, as the pool adapters share ``block_pool_api``.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.model.manager import Blocks


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
