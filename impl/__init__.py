"""kvpool.impl: the fast block pool, with kvpool.model's semantics and vLLM's interface."""

from kvpool.impl import pool as _pool
from kvpool.impl.block import KVCacheBlock
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.impl.hisparse_view import get_hisparse_coordinator
from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.impl.pool import BlockPool, MetricsCollector

COMPILED: bool = not (_pool.__file__ or "").endswith(".py")
"""True when the mypyc-compiled build of kvpool.impl is loaded (``pip install .`` with a C
compiler); False for the pure-Python one (no compiler, ``KVPOOL_PURE=1``, editable installs)."""

__all__ = [
    "COMPILED",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheManager",
    "MetricsCollector",
    "get_hisparse_coordinator",
]
