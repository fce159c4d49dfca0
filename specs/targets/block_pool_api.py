"""An adapter for pools with vLLM's ``BlockPool`` API: block objects, duck-typed requests.

``kvpool.impl.BlockPool`` has that API, and so do vLLM's own pool and its forks;
the vLLM adapter specialises the few places where vLLM's types differ.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolState, Reuse


class BlockPoolApiTarget:
    """Translates block ids to the pool's block objects and back."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._watchers: dict[int, Callable[[Any], None]] = {}
        self._watcher_ids: dict[int, int] = {}
        self._reuses: list[Reuse] = []

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
        replace_existing_hashes: bool = False,
    ) -> HashKey | None:
        (block,) = self._blocks([block_id])
        extra = (True,) if replace_existing_hashes else ()
        key = self.pool.cache_partial_block(
            self.request(request), block, num_tokens, kv_cache_group_id, block_size, *extra
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

    # vLLM 0.33's operations (kvpool.specs.pool.target.PoolTargetExtensions) ---------

    def watcher(self, watcher: int) -> Callable[[Any], None]:
        """The callback registered for the machine's ``watcher``: it records a ``Reuse``.

        One callback per watcher id, so the pool's registry maps back to ids.
        """
        if watcher not in self._watchers:

            def on_reuse(block: Any) -> None:
                self._reuses.append(Reuse(watcher, block.block_id, self.hash_key(block.block_hash)))

            self._watchers[watcher] = on_reuse
            self._watcher_ids[id(on_reuse)] = watcher
        return self._watchers[watcher]

    def unpin_blocks(self, block_ids: Sequence[int], watcher: int) -> None:
        self.pool.unpin_blocks(self._blocks(block_ids), self.watcher(watcher))

    def take_reuses(self) -> Sequence[Reuse]:
        reuses, self._reuses = self._reuses, []
        return reuses

    def move_block_hashes(self, src: int, dst: int) -> None:
        src_block, dst_block = self._blocks([src, dst])
        self.pool.move_block_hashes(src_block, dst_block)

    def is_block_writable(self, block_id: int) -> bool:
        (block,) = self._blocks([block_id])
        return bool(self.pool.is_block_writable(block))

    def emit_cached_block_events(
        self,
        request: CacheRequest,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        self.pool.emit_cached_block_events(
            self.request(request), num_cached_blocks, block_size, kv_cache_group_id
        )

    def with_watchers(self, state: PoolState, registry: dict[int, Any]) -> PoolState:
        """``state`` with the pool's watcher ``registry`` (block id -> callback) as watcher
        ids, and the reuses recorded and not yet taken."""
        watchers = {b: self._watcher_ids.get(id(w), -1) for b, w in registry.items()}
        return replace(state, watchers=watchers, pending_reuses=tuple(self._reuses))
