"""The pool layer's target protocol: what a block pool must offer to be checked.

Targets speak block *ids*, not objects, so any implementation fits behind a
thin adapter: a Python class, vLLM's own pool, or a program in another
language. Rejections are reported by raising the model's exception classes
(``kvpool.model.errors``); conformance compares their types only.

``snapshot()`` is optional. Without it the kit checks what callers can
observe (block ids handed out, cache hits, counts, usage, events); with it,
the whole state is compared with the model after every operation.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolState
from kvpool.specs.errors import TargetError

__all__ = [
    "FEATURES",
    "OPERATIONS",
    "Normalizing",
    "PoolTarget",
    "Snapshottable",
    "TargetError",
    "TargetFactory",
]

OPERATIONS = (
    "get_new_blocks",
    "touch",
    "free_blocks",
    "cache_full_blocks",
    "cache_partial_block",
    "get_cached_block",
    "evict_blocks",
    "reset_prefix_cache",
    "get_num_free_blocks",
    "get_usage",
    "take_events",
    "snapshot",
)
"""The operations of ``PoolTarget`` (and the optional ``snapshot``), named as in
``kvpool.model``: the one list the machine, the protocol and the vectors share."""

FEATURES = ("block_mask", "block_size_multiple", "events")
"""What a pool may lack beside whole operations: ``cache_full_blocks``'s
``block_mask`` argument, blocks several hash blocks long, and KV events. A target
that lacks one (an old vLLM release) is checked on programs that never use it."""


class PoolTarget(Protocol):
    """A v1 block pool under test. Method semantics: see ``kvpool.model.pool``."""

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]: ...

    def touch(self, block_ids: Sequence[int]) -> None: ...

    def free_blocks(self, block_ids: Sequence[int]) -> None: ...

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None: ...

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None: ...

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None: ...

    def evict_blocks(self, block_ids: Iterable[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_free_blocks(self) -> int: ...

    def get_usage(self) -> float: ...

    def take_events(self) -> Sequence[KVCacheEvent]: ...


@runtime_checkable
class Snapshottable(Protocol):
    """A target that can show its whole state as the model's ``PoolState``."""

    def snapshot(self) -> PoolState: ...


class Normalizing(Protocol):
    """Optional hooks for targets that are right but order some things differently.

    ``normalize_state`` and ``normalize_events`` are applied to *both* sides
    before comparing: use them only for orders the specification leaves open
    (for example vLLM keeps a block's partial keys in a set). Each use must be
    justified in docs/semantics.md.
    """

    def normalize_state(self, state: PoolState) -> PoolState: ...

    def normalize_events(self, events: Sequence[KVCacheEvent]) -> Sequence[KVCacheEvent]: ...


TargetFactory = Callable[[PoolConfig], PoolTarget]
"""Builds a fresh target for a pool configuration; called once per test case."""
