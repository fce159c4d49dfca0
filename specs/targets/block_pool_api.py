"""An adapter for pools with vLLM's ``BlockPool`` API: block objects, duck-typed requests.

``kvpool.impl.BlockPool`` has that API, and so do vLLM's own pool and its forks;
the vLLM adapter specialises the few places where vLLM's types differ.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.model import CacheRequest, HashKey, KVCacheEvent


class BlockPoolApiTarget:
    """Translates block ids to the pool's block objects and back."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    # Hooks for pools whose types differ from kvpool's -----------------------

    def request(self, request: CacheRequest) -> Any:
        """The request object handed to the pool's cache methods."""
        return request

    def hash_key(self, key: Any) -> HashKey | None:
        """The pool's hash-with-group value as the model's (hash, group) pair."""
        return None if key is None else (bytes(key[0]), int(key[1]))

    def event(self, event: Any) -> KVCacheEvent:
        """One of the pool's events as the model's event."""
        return event  # type: ignore[no-any-return]

    # The target protocol ------------------------------------------------------

    def _blocks(self, block_ids: Iterable[int]) -> list[Any]:
        """The pool's block objects; an unknown id becomes a block of no pool.

        The stand-in lets the pool itself reject the call, with the model's
        exception, after the preconditions the model checks first.
        """
        blocks = self.pool.blocks
        stand_in = type(self.pool.null_block)
        return [blocks[b] if 0 <= b < len(blocks) else stand_in(b) for b in block_ids]

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        return [b.block_id for b in self.pool.get_new_blocks(num_blocks)]

    def touch(self, block_ids: Sequence[int]) -> None:
        self.pool.touch(self._blocks(block_ids))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks(self._blocks(block_ids))

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        self.pool.cache_full_blocks(
            self.request(request),
            self._blocks(block_ids),
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            None if block_mask is None else list(block_mask),
        )

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None:
        (block,) = self._blocks([block_id])
        key = self.pool.cache_partial_block(
            self.request(request), block, num_tokens, kv_cache_group_id, block_size
        )
        return self.hash_key(key)

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        blocks = self.pool.get_cached_block(block_hash, list(kv_cache_group_ids))
        return None if blocks is None else [b.block_id for b in blocks]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.pool.evict_blocks(set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self.pool.reset_prefix_cache())

    def get_num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_usage(self) -> float:
        return float(self.pool.get_usage())

    def take_events(self) -> Sequence[KVCacheEvent]:
        return [self.event(e) for e in self.pool.take_events()]
