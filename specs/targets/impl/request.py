"""kvpool's own fast KV cache manager as a manager target."""

from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.model.events import KVCacheEvent
from kvpool.model.manager import Blocks, KVCacheManagerState, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.targets.impl.hisparse import HiSparseCalls, hisparse_config
from kvpool.specs.targets.manager_api import (
    SchedulerCalls,
    block_ids,
    connector_arguments,
    copy_ids,
    without_annotation,
)


class ImplManagerTarget(SchedulerCalls, HiSparseCalls):
    """``kvpool.impl.manager.KVCacheManager`` behind the manager protocol, with its snapshot;
    built with ``setup.hisparse``, also behind ``ManagerTargetHiSparse``
    (``kvpool.specs.targets.impl.hisparse``).

    ``manager_class`` lets tests check a modified copy of the impl.
    """

    manager_class: type[KVCacheManager] = KVCacheManager
    manager: KVCacheManager

    def __init__(self, setup: ManagerSetup) -> None:
        self.specs = setup.specs
        self._held = {}
        config: Any = KVCacheConfig(
            setup.num_blocks,
            setup.specs,
            prefix_cache_retention_interval=setup.retention_interval,
            eagle_groups=setup.eagle_groups,
        )
        if setup.hisparse is not None:
            config = hisparse_config(setup, setup.hisparse)
        self.manager = self.manager_class(
            config,
            setup.max_model_len,
            hash_block_size=setup.hash_block_size,
            enable_caching=setup.enable_caching,
            use_eagle=setup.use_eagle,
            log_stats=setup.log_stats,
            enable_kv_cache_events=setup.enable_events,
            profile=setup.profile,
            fine_grained_hits=setup.fine_grained_hits,
            max_in_flight_tokens=setup.max_in_flight_tokens,
            num_prefill_lookahead=setup.num_prefill_lookahead,
            scheduler_block_size=setup.scheduler_block_size,
            dcp_world_size=setup.dcp_world_size,
            pcp_world_size=setup.pcp_world_size,
        )

    def snapshot(self) -> KVCacheManagerState:
        return self.manager.snapshot()

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        blocks, num_tokens, _ = self.manager.get_computed_blocks(request)
        return block_ids(blocks), num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> Blocks | None:
        hits = None
        if new_computed_blocks is not None:
            hits = KVCacheBlocks(tuple([self._block(b) for b in g] for g in new_computed_blocks))
        blocks = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks,
            # only when asked for, so that a subclass predating the argument still runs
            **({"full_sequence_must_fit": True} if full_sequence_must_fit else {}),
            **connector_arguments(
                num_external_computed_tokens, reserved_blocks, skip_zeroing_group_ids
            ),
        )
        return None if blocks is None else block_ids(blocks)

    def _block(self, block_id: int) -> KVCacheBlock:
        """The pool's block, or for an id it does not have, a block of no pool.

        The stand-in lets the manager itself refuse the unknown block, in its
        own checking order, as it would refuse another pool's block.
        """
        blocks = self.manager.block_pool.blocks
        if 0 <= block_id < len(blocks):
            return blocks[block_id]
        return KVCacheBlock(block_id)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.manager.evict_blocks(set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int]:
        return self.manager.get_num_common_prefix_blocks(request_id)

    def get_block_ids(self, request_id: str) -> Blocks:
        return tuple(tuple(g) for g in self.manager.get_block_ids(request_id))

    def take_events(self) -> Sequence[KVCacheEvent]:
        # the manager stamps each BlockStored with its group's spec; checked, then dropped
        return tuple(without_annotation(e, self.specs) for e in self.manager.take_events())

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.manager.make_prefix_cache_stats()

    def usage(self) -> float:
        return self.manager.usage

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    # vLLM 0.33's further scheduler calls

    def get_computed_blocks_with_boundary(self, request: Request) -> tuple[Blocks, int, int]:
        blocks, num_tokens, boundary = self.manager.get_computed_blocks(request)
        return block_ids(blocks), num_tokens, boundary

    def take_kv_cache_block_copies(self) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
        return copy_ids(*self.manager.take_kv_cache_block_copies())

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.manager.block_pool.free_blocks([self._block(b) for b in block_ids])

    def truncate_computed_blocks(self, blocks: Blocks, num_computed_tokens: int) -> Blocks:
        hit = KVCacheBlocks(tuple([self._block(b) for b in g] for g in blocks))
        return block_ids(self.manager.truncate_computed_blocks(hit, num_computed_tokens))

    def take_new_block_ids(self) -> Sequence[int]:
        return tuple(self.manager.take_new_block_ids())

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.manager.estimate_cached_tokens(request)

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()
