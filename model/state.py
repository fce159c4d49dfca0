"""The pool's state: plain immutable data, nothing else.

A block is *held* while its ref count is above zero, *free* while it sits in
the free queue, and *cached* while at least one hash key points at it. A free
block can be cached at the same time: it is an eviction candidate, reusable by
a cache hit until get_new_blocks hands it out and drops its hashes.
"""

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from kvpool.model.events import MEDIUM_GPU, KVCacheEvent
from kvpool.model.profiles import DEFAULT_PROFILE, Profile

BlockHash = bytes
"""An opaque block hash. The pool compares hashes for equality and nothing else."""

HashKey = tuple[BlockHash, int]
"""A hash together with the id of the KV cache group it belongs to."""

NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class PoolConfig:
    """The parameters a pool is built with; they never change."""

    num_blocks: int
    enable_caching: bool = True
    hash_block_size: int = 1
    enable_events: bool = False
    profile: Profile = DEFAULT_PROFILE
    medium: str = MEDIUM_GPU
    """Where the pool's blocks live; copied into every BlockStored and BlockRemoved."""
    num_hash_lookahead_tokens: int = 0
    """Tokens after each block its hash also covers; only the events show them."""


@dataclass(frozen=True)
class BlockState:
    """What the pool knows about one physical block."""

    ref_cnt: int = 0
    block_hash: HashKey | None = None
    """The primary key: the first key inserted for this block."""
    hash_num_tokens: int | None = None
    """How many prefix tokens the primary key covers."""
    partial_keys: tuple[HashKey, ...] = ()
    """Further keys pointing at this block (partial entries), in insertion order."""

    def hash_keys(self) -> tuple[HashKey, ...]:
        """Every key that points at this block: the primary one first."""
        primary = () if self.block_hash is None else (self.block_hash,)
        return primary + self.partial_keys


Watcher = Hashable
"""Whoever asked to hear when an unpinned block is reused: any hashable value in the
model; the impl and vLLM take a callable that gets the block."""


@dataclass(frozen=True)
class Reuse:
    """A watcher fired: the block it watched is about to be reused or forgotten.

    ``block_hash`` is the primary key the block still carried when the watcher
    fired (the pool fires before it drops the block's keys).
    """

    watcher: Watcher
    block_id: int
    block_hash: HashKey | None


@dataclass(frozen=True)
class PoolState:
    """A whole block pool. ``blocks[i]`` describes block id ``i``; block 0 is the null block."""

    config: PoolConfig
    blocks: tuple[BlockState, ...]
    free_queue: tuple[int, ...]
    """Free block ids; the front is evicted (handed out) first."""
    cached: Mapping[HashKey, tuple[int, ...]] = field(default_factory=dict)
    """Hash key to the ids of the blocks under it, oldest insertion first. Never mutated."""
    pending_events: tuple[KVCacheEvent, ...] = ()
    watchers: Mapping[int, Watcher] = field(default_factory=dict)
    """Block id to the watcher ``unpin_blocks`` registered for it, in registration
    order (a re-registration keeps its place). Never mutated."""
    pending_reuses: tuple[Reuse, ...] = ()
    """Watchers that fired and were not yet taken (``take_reuses``), oldest first."""


@dataclass(frozen=True)
class CacheRequest:
    """The part of a request the pool reads when caching its blocks.

    ``block_hashes[i]`` is the chained hash of the first ``(i + 1) * hash_block_size``
    tokens; ``all_token_ids`` only feeds the events.
    """

    block_hashes: tuple[BlockHash, ...]
    all_token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    lora_name: str | None = None
