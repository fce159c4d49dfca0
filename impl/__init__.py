"""kvpool.impl: the fast block pool, with kvpool.model's semantics and vLLM's interface."""

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.impl.pool import BlockPool, MetricsCollector

__all__ = [
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheManager",
    "MetricsCollector",
]
