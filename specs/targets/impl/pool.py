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
                num_hash_lookahead_tokens=config.num_hash_lookahead_tokens,
                medium=config.medium,
                profile=config.profile,
            )
        )

    @staticmethod
    def unsupported_operations() -> frozenset[str]:
        """Nothing: the impl has every operation and feature of vLLM 0.33's pool."""
        return frozenset()

    def snapshot(self) -> PoolState:
        state: PoolState = self.pool.snapshot()
        return self.with_watchers(state, self.pool._reuse_watchers)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
