"""Copies of the impl with one bug planted each: the harness must find them.

These test the *harness*, not the impl: each is a real mistake a block-pool
author makes, and the lock-step machine must find it and shrink it to a short
program.
"""

from collections.abc import Iterable
from typing import Any

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import PoolConfig
from kvpool.specs.targets.impl.pool import ImplTarget


class AppendsHashlessBlocks(BlockPool):
    """Frees every block to the back, as vLLM did before 0.24, while claiming the new profile."""

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        freed = [b for b in dict.fromkeys(blocks) if b.ref_cnt == 0 and not b.is_null]
        for block in freed:
            self.free_block_queue.remove(block)
        for block in freed:
            self.free_block_queue.append(block)


class KeepsStaleHashOnReuse(BlockPool):
    """Hands out an evicted cached block but leaves its entry in the hash map.

    A later lookup of that hash returns a block now holding other tokens: the
    server serves wrong KV data, and nothing crashes.
    """

    def get_new_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        self._drop_keys = self._forget_but_keep_map_entry  # type: ignore[method-assign]
        try:
            return super().get_new_blocks(num_blocks)
        finally:
            del self._drop_keys

    @staticmethod
    def _forget_but_keep_map_entry(block: KVCacheBlock) -> None:
        block._hash = None
        block._group = 0
        block._block_hash_num_tokens = 0
        block._extra_keys = None


def target_of(pool_class: type[BlockPool]) -> Any:
    """A target factory that builds ``pool_class`` instead of the impl's pool."""

    def make(config: PoolConfig) -> ImplTarget:
        target = ImplTarget(config)
        target.pool = pool_class(
            config.num_blocks,
            enable_caching=config.enable_caching,
            hash_block_size=config.hash_block_size,
            enable_kv_cache_events=config.enable_events,
            profile=config.profile,
        )
        return target

    return make


class RemovesEveryCopy(BlockPool):
    """Claims the last-copy event semantics but publishes a removal per copy, as vLLM does.

    A router told the last-copy contract forgets a prefix another block still holds.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._removal_per_copy = True
