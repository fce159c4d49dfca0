"""The model's KV cache manager as a manager target: the reference the others are compared with."""

from collections.abc import Iterable, Mapping, Sequence
from functools import partial

from kvpool.model import hisparse as model_hisparse
from kvpool.model import hisparse_core, scheduler_calls
from kvpool.model import manager as model_manager
from kvpool.model import pool as pool_ops
from kvpool.model.events import KVCacheEvent
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror
from kvpool.model.manager import Blocks, KVCacheManagerState, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.specs.request.target import (
    HiSparseView,
    ManagerSetup,
    PoolBlock,
    geometry_arguments,
    retention_arguments,
)


def hisparse_view(state: KVCacheManagerState) -> HiSparseView:
    """The model's HiSparse manager as the machine compares it (``HiSparseView``)."""
    host, books = state.host_pool, state.hisparse
    assert host is not None and books is not None, "not a HiSparse manager"
    device = state.managers.pool
    return HiSparseView(
        device_blocks=tuple((b.ref_cnt, b.block_hash is not None) for b in device.blocks),
        device_free=tuple(device.free_queue),
        host_blocks=tuple((b.ref_cnt, b.block_hash is not None) for b in host.blocks),
        host_free=tuple(host.free_queue),
        hot_required=frozenset(books.hot_required),
        copies=tuple(sorted(books.copies.values())),
        pending_work=model_hisparse.has_pending_work(state),
        pending_reclamation=model_hisparse.has_pending_reclamation(state),
        books={
            r: (
                frozenset(b.valid),
                b.ready_prefix_pages,
                dict(b.pending),
                frozenset(b.pinned_clean),
                b.synced_pages,
            )
            for r, b in books.books.items()
        },
    )


def press_pool(
    state: KVCacheManagerState, pool: str, count: int
) -> tuple[KVCacheManagerState, tuple[int, ...]]:
    """``get_new_blocks(count)`` on one of a HiSparse manager's pools ("CPU": the host's)."""
    t = model_manager.tiers(state)
    on = hisparse_core.host_pool if pool == "CPU" else hisparse_core.device_pool
    t, ids = on(t, partial(pool_ops.get_new_blocks, num_blocks=count))
    return model_manager.with_tiers(state, t), tuple(ids)


def release_pool(
    state: KVCacheManagerState, pool: str, block_ids: Sequence[int]
) -> tuple[KVCacheManagerState, None]:
    """``free_blocks`` on one of a HiSparse manager's pools, in the listed order."""
    t = model_manager.tiers(state)
    on = hisparse_core.host_pool if pool == "CPU" else hisparse_core.device_pool
    t, _ = on(t, partial(pool_ops.free_blocks, ordered_block_ids=list(block_ids)))
    return model_manager.with_tiers(state, t), None


class ModelManagerTarget:
    """Holds a model state and replaces it with each operation's result."""

    def __init__(self, setup: ManagerSetup) -> None:
        if setup.hisparse is not None:
            self.state = model_manager.new_hisparse_manager(
                setup.num_blocks,
                setup.specs,
                setup.max_model_len,
                setup.hisparse,
                hash_block_size=setup.hash_block_size,
                enable_caching=setup.enable_caching,
                log_stats=setup.log_stats,
                enable_events=setup.enable_events,
                profile=setup.profile,
                max_in_flight_tokens=setup.max_in_flight_tokens,
                num_prefill_lookahead=setup.num_prefill_lookahead,
            )
            return
        self.state = model_manager.new_kv_cache_manager(
            setup.num_blocks,
            setup.specs,
            setup.max_model_len,
            hash_block_size=setup.hash_block_size,
            enable_caching=setup.enable_caching,
            use_eagle=setup.use_eagle,
            log_stats=setup.log_stats,
            enable_events=setup.enable_events,
            profile=setup.profile,
            fine_grained_hits=setup.fine_grained_hits,
            max_in_flight_tokens=setup.max_in_flight_tokens,
            num_prefill_lookahead=setup.num_prefill_lookahead,
            **geometry_arguments(setup),
            **retention_arguments(setup),
            eagle_groups=setup.eagle_groups,
        )

    def snapshot(self) -> KVCacheManagerState:
        return self.state

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        self.state, result = model_manager.get_computed_blocks(self.state, request)
        return result

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
        self.state, blocks = model_manager.allocate_slots(
            self.state,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            num_external_computed_tokens=num_external_computed_tokens,
            reserved_blocks=reserved_blocks,
            skip_zeroing_group_ids=skip_zeroing_group_ids,
        )
        return blocks

    def free(self, request: Request) -> None:
        self.state, _ = model_manager.free(self.state, request.request_id)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.state, _ = model_manager.cache_blocks(self.state, request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.state, _ = model_manager.evict_blocks(self.state, block_ids)

    def reset_prefix_cache(self) -> bool:
        self.state, done = model_manager.reset_prefix_cache(self.state)
        return done

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int]:
        return model_manager.get_num_common_prefix_blocks(self.state, request_id)

    def get_block_ids(self, request_id: str) -> Blocks:
        return model_manager.get_block_ids(self.state, request_id)

    def take_events(self) -> Sequence[KVCacheEvent]:
        self.state, events = model_manager.take_events(self.state)
        return events

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        self.state, stats = model_manager.make_prefix_cache_stats(self.state)
        return stats

    def usage(self) -> float:
        return model_manager.usage(self.state)

    def num_free_blocks(self) -> int:
        return model_manager.num_free_blocks(self.state)

    # vLLM 0.33's further scheduler calls

    def get_computed_blocks_with_boundary(self, request: Request) -> tuple[Blocks, int, int]:
        self.state, result = model_manager.get_computed_blocks_with_boundary(self.state, request)
        return result

    def take_kv_cache_block_copies(
        self,
    ) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
        self.state, result = model_manager.take_kv_cache_block_copies(self.state)
        return result

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.state, _ = model_manager.free_blocks(self.state, block_ids)

    def truncate_computed_blocks(self, blocks: Blocks, num_computed_tokens: int) -> Blocks:
        return model_manager.truncate_computed_blocks(self.state, blocks, num_computed_tokens)

    def take_new_block_ids(self) -> Sequence[int]:
        self.state, ids = model_manager.take_new_block_ids(self.state)
        return ids

    def estimate_cached_tokens(self, request: Request) -> int:
        return model_manager.estimate_cached_tokens(self.state, request.request_id)

    def new_step_starts(self) -> None:
        self.state, _ = model_manager.new_step_starts(self.state)

    # the rest of vLLM 0.33's scheduler calls

    def pop_blocks_for_free(self, request: Request) -> Sequence[int]:
        self.state, blocks = scheduler_calls.pop_blocks_for_free(self.state, request.request_id)
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        self.state, _ = scheduler_calls.remove_skipped_blocks(
            self.state, request_id, processed_computed_tokens
        )

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> Blocks:
        return scheduler_calls.get_block_ids_for_computed_tokens(
            self.state, request_id, num_computed_tokens
        )

    def get_computed_blocks_for_connector(self, request: Request) -> tuple[Blocks, int, int, bool]:
        self.state, result = scheduler_calls.get_computed_blocks_for_connector(self.state, request)
        return result

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.state, _ = scheduler_calls.record_blocks_for_zeroing(
            self.state, request_id, start_token
        )

    def take_boundary_state_offloads(self) -> Mapping[str, Sequence[tuple[int, int, int]]]:
        self.state, offloads = scheduler_calls.take_boundary_state_offloads(self.state)
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> Sequence[tuple[int, int, int]]:
        self.state, tails = scheduler_calls.finalize_partial_tail_offloads(self.state, request)
        return tails

    # vLLM 0.33's HiSparse coordinator (ManagerTargetHiSparse)

    def free_request(self, request: Request, finished: bool) -> None:
        self.state, _ = model_manager.free(self.state, request.request_id, finished=finished)

    def pop_pool_blocks_for_free(self, request: Request, finished: bool) -> Sequence[PoolBlock]:
        self.state, blocks = model_hisparse.pop_blocks_for_free(
            self.state, request.request_id, finished=finished
        )
        return blocks

    def free_pool_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        self.state, _ = model_hisparse.free_pool_blocks(self.state, blocks)

    def advance_scheduled(self, scheduled: Sequence[tuple[str, int]]) -> None:
        self.state, _ = model_hisparse.advance_scheduled(self.state, scheduled)

    def build_offload_command(self) -> Sequence[PageTransfer]:
        self.state, transfers = model_hisparse.build_offload_command(self.state)
        return transfers

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        self.state, _ = model_hisparse.update_spills(self.state, enqueued, completed)

    def build_row_mirrors(self, spans: Sequence[tuple[str, int, int]]) -> Sequence[RowMirror]:
        return model_hisparse.build_row_mirrors(self.state, spans)

    def all_context_pages_resident(self, spans: Sequence[tuple[str, int, int]]) -> bool:
        self.state, answer = model_hisparse.all_context_pages_resident(self.state, spans)
        return answer

    def take_residency_updates(self, request_ids: Sequence[str]) -> Mapping[str, ResidencyUpdate]:
        self.state, updates = model_hisparse.take_residency_updates(self.state, request_ids)
        return updates

    def require_hot(self, request_id: str) -> None:
        self.state, _ = model_hisparse.require_hot(self.state, request_id)

    def press_pool(self, pool: str, count: int) -> Sequence[int]:
        self.state, ids = press_pool(self.state, pool, count)
        return ids

    def release_pool(self, pool: str, block_ids: Sequence[int]) -> None:
        self.state, _ = release_pool(self.state, pool, block_ids)

    def hisparse_view(self) -> HiSparseView:
        return hisparse_view(self.state)
