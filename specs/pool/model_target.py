"""The model itself as a target: the reference every other target is compared with."""

from collections.abc import Iterable, Sequence

from kvpool import model
from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolState, Reuse


class ModelTarget:
    """Holds a model state and replaces it with each operation's result."""

    def __init__(self, config: PoolConfig) -> None:
        self.state = model.new_pool(
            config.num_blocks,
            enable_caching=config.enable_caching,
            hash_block_size=config.hash_block_size,
            enable_events=config.enable_events,
            profile=config.profile,
            medium=config.medium,
            num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
        )

    @staticmethod
    def unsupported_operations() -> frozenset[str]:
        """Nothing: the model is the reference."""
        return frozenset()

    def snapshot(self) -> PoolState:
        return self.state

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        self.state, ids = model.get_new_blocks(self.state, num_blocks)
        return ids

    def touch(self, block_ids: Sequence[int]) -> None:
        self.state, _ = model.touch(self.state, block_ids)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.state, _ = model.free_blocks(self.state, block_ids)

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
        self.state, _ = model.cache_full_blocks(
            self.state,
            request,
            block_ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> HashKey | None:
        self.state, key = model.cache_partial_block(
            self.state,
            request,
            block_id,
            num_tokens,
            kv_cache_group_id,
            block_size,
            replace_existing_hashes,
        )
        return key

    def unpin_blocks(self, block_ids: Sequence[int], watcher: int) -> None:
        self.state, _ = model.unpin_blocks(self.state, block_ids, watcher)

    def take_reuses(self) -> Sequence[Reuse]:
        self.state, reuses = model.take_reuses(self.state)
        return reuses

    def move_block_hashes(self, src: int, dst: int) -> None:
        self.state, _ = model.move_block_hashes(self.state, src, dst)

    def is_block_writable(self, block_id: int) -> bool:
        return model.is_block_writable(self.state, block_id)

    def emit_cached_block_events(
        self,
        request: CacheRequest,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        self.state, _ = model.emit_cached_block_events(
            self.state, request, num_cached_blocks, block_size, kv_cache_group_id
        )

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        return model.get_cached_block(self.state, block_hash, kv_cache_group_ids)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.state, _ = model.evict_blocks(self.state, block_ids)

    def reset_prefix_cache(self) -> bool:
        self.state, done = model.reset_prefix_cache(self.state)
        return done

    def get_num_free_blocks(self) -> int:
        return model.get_num_free_blocks(self.state)

    def get_usage(self) -> float:
        return model.get_usage(self.state)

    def take_events(self) -> Sequence[KVCacheEvent]:
        self.state, events = model.take_events(self.state)
        return events
