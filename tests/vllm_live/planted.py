"""Bugs planted in a live vLLM 0.32 engine, for the live path to find.

Each function is called (``--plant tests.vllm_live.planted:NAME``) before the
recorder wraps the engine's classes and before ``LLM(...)`` is built; it
returns the pool subclasses the recorder must wrap too. Served tokens do not
change: both bugs are silent in the engine's own output.
"""

from typing import Any


def stale_hash() -> list[type]:
    """Evicting a cached block forgets the block's hash but leaves its key in the
    cache's map: a later lookup of that prefix hits a block that now holds
    another request's KV. A ``BlockPool`` subclass, bound where the engine's
    coordinator builds its pool."""
    from vllm.v1.core import block_pool, kv_cache_coordinator

    def evict_keeping_the_key(self: Any, block: Any) -> bool:
        had_key = (
            block.block_hash is not None or block.block_id in self.cached_block_hashes_by_block
        )
        self.cached_block_hashes_by_block.pop(block.block_id, None)
        block.reset_hash()  # the bug: the key stays in cached_block_hash_to_block
        return had_key

    stale = type(
        "StaleHashBlockPool",
        (block_pool.BlockPool,),
        {"_maybe_evict_cached_block": evict_keeping_the_key},
    )
    kv_cache_coordinator.BlockPool = stale
    return [stale]


def forward_free() -> list[type]:
    """A finished or preempted request's blocks are freed head first instead of
    tail first, so a prefix's head is evicted before its tail. Patched on the
    full-attention manager class: vLLM re-registers its own manager classes
    while the engine is built, so a subclass would not be picked up."""
    from vllm.v1.core import single_type_kv_cache_manager as managers

    def free_head_first(self: Any, request_id: str) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    managers.FullAttentionManager.free = free_head_first
    return []
