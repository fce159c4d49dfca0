"""kvpool's own fast pool as a target."""

from kvpool.impl import BlockPool
from kvpool.model import PoolConfig, PoolState
from kvpool.specs.targets.block_pool_api import BlockPoolApiTarget


class ImplTarget(BlockPoolApiTarget):
    """``kvpool.impl.BlockPool`` behind the target protocol, with its snapshot."""

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(
            BlockPool(
                config.num_blocks,
                enable_caching=config.enable_caching,
                hash_block_size=config.hash_block_size,
                enable_kv_cache_events=config.enable_events,
                profile=config.profile,
            )
        )

    def snapshot(self) -> PoolState:
        state: PoolState = self.pool.snapshot()
        return state

    def check_invariants(self) -> None:
        self.pool.check_invariants()
