"""kvpool.model: the executable specification of vLLM's v1 block pool.

Read ``pool.py`` top to bottom: one pure function per operation over the
immutable data of ``state.py``. The request layer builds on it: ``hashing.py``
(block hashes), ``request.py``, ``single_type.py`` (one KV cache group per
attention type) and ``manager.py`` (the KV cache manager). Nothing here
imports anything else of kvpool.
"""

from kvpool.model.errors import (
    AlreadyCached,
    BlockNotHeld,
    CachingDisabled,
    DuplicateBlock,
    InvalidBlockCount,
    InvalidBlockMask,
    InvalidBlockRange,
    InvalidBlockSize,
    InvalidConfig,
    InvalidGroup,
    InvalidPartialBlock,
    NotEnoughFreeBlocks,
    NotEnoughHashes,
    OverFree,
    PoolError,
    UnknownBlock,
)
from kvpool.model.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvpool.model.hashing import NONE_HASH
from kvpool.model.pool import (
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    get_num_free_blocks,
    get_usage,
    hashes_at_block_size,
    new_pool,
    reset_prefix_cache,
    take_events,
    touch,
)
from kvpool.model.profiles import (
    APPEND,
    DEFAULT_PROFILE,
    HASHLESS_FIRST,
    HASHLESS_FIRST_APPEND_UNCACHED,
    PROFILES,
    FreeOrder,
    Profile,
)
from kvpool.model.request import Request
from kvpool.model.state import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockState,
    CacheRequest,
    HashKey,
    PoolConfig,
    PoolState,
)

__all__ = [
    "APPEND",
    "DEFAULT_PROFILE",
    "HASHLESS_FIRST",
    "HASHLESS_FIRST_APPEND_UNCACHED",
    "MEDIUM_GPU",
    "NONE_HASH",
    "NULL_BLOCK_ID",
    "PROFILES",
    "AllBlocksCleared",
    "AlreadyCached",
    "BlockHash",
    "BlockNotHeld",
    "BlockRemoved",
    "BlockState",
    "BlockStored",
    "CacheRequest",
    "CachingDisabled",
    "DuplicateBlock",
    "FreeOrder",
    "HashKey",
    "InvalidBlockCount",
    "InvalidBlockMask",
    "InvalidBlockRange",
    "InvalidBlockSize",
    "InvalidConfig",
    "InvalidGroup",
    "InvalidPartialBlock",
    "KVCacheEvent",
    "NotEnoughFreeBlocks",
    "NotEnoughHashes",
    "OverFree",
    "PoolConfig",
    "PoolError",
    "PoolState",
    "Profile",
    "Request",
    "UnknownBlock",
    "cache_full_blocks",
    "cache_partial_block",
    "evict_blocks",
    "free_blocks",
    "get_cached_block",
    "get_new_blocks",
    "get_num_free_blocks",
    "get_usage",
    "hashes_at_block_size",
    "new_pool",
    "reset_prefix_cache",
    "take_events",
    "touch",
]
