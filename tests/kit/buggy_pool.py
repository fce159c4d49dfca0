"""A planted bug: kvpool.impl with free_blocks appending hash-less blocks at the back.

That is the pre-0.24 free order (profile ``append``) in a pool that claims the
default ``hashless-first``: no result differs until the queue order matters,
so only the state comparison (or a later allocation) notices.
"""

from collections.abc import Iterable
from typing import Any

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import PoolConfig
from kvpool.specs.targets.impl.pool import ImplTarget


class AppendingBlockPool(BlockPool):
    """free_blocks puts every freed block at the back, hash-less ones included.

    Built on the public queue API only (remove, append), so it keeps working
    whatever the impl does inside free_blocks.
    """

    __slots__ = ()

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        was_free = {b.block_id for b in self.free_block_queue.get_all_free_blocks()}
        super().free_blocks(blocks)
        moved: set[int] = set()
        for block in blocks:
            freed = block.ref_cnt == 0 and block.block_id not in was_free and not block.is_null
            if freed and block.block_hash is None and block.block_id not in moved:
                self.free_block_queue.remove(block)
                self.free_block_queue.append(block)
                moved.add(block.block_id)


class BuggyTarget(ImplTarget):
    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.pool = AppendingBlockPool(
            config.num_blocks,
            enable_caching=config.enable_caching,
            hash_block_size=config.hash_block_size,
            enable_kv_cache_events=config.enable_events,
            profile=config.profile,
        )


class BuggyNoSnapshot:
    """The same bug behind a target without snapshot(): only results can show it."""

    def __init__(self, config: PoolConfig) -> None:
        self._inner = BuggyTarget(config)

    def __getattr__(self, name: str) -> Any:  # every attribute of the inner target but one
        if name == "snapshot":
            raise AttributeError(name)
        return getattr(self._inner, name)


def make_target(config: PoolConfig) -> BuggyTarget:
    return BuggyTarget(config)


class WrongUsage(ImplTarget):
    """Reports usage off by a quarter: diverges before the first operation."""

    def get_usage(self) -> float:
        return super().get_usage() + 0.25
