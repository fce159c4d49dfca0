"""Reading what a manager with vLLM's ``KVCacheManager`` API returns, as the protocol's ids.

``kvpool.impl.KVCacheManager`` has that API, and so do vLLM's own manager and
its forks: both request-layer adapters read block objects and copy records
through these, as the pool adapters share ``block_pool_api``.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvpool.model.events import BlockStored, KVCacheEvent
from kvpool.model.manager import Blocks
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.specs.request.target import HiSparseView


def connector_arguments(
    num_external_computed_tokens: int, reserved_blocks: int, skip_zeroing_group_ids: Any
) -> dict[str, Any]:
    """``allocate_slots``' KV-connector keywords (vLLM 0.33) that differ from their defaults:
    passed only when set, so that a manager predating them is never asked for them.

    >>> connector_arguments(4, 0, ())
    {'num_external_computed_tokens': 4}
    """
    chosen: dict[str, Any] = {}
    if num_external_computed_tokens:
        chosen["num_external_computed_tokens"] = num_external_computed_tokens
    if reserved_blocks:
        chosen["reserved_blocks"] = reserved_blocks
    if skip_zeroing_group_ids:
        chosen["skip_zeroing_group_ids"] = tuple(skip_zeroing_group_ids)
    return chosen


def block_ids(blocks: Any) -> Blocks:
    """The block ids of a ``KVCacheBlocks``, group by group."""
    return tuple(tuple(b.block_id for b in group) for group in blocks.blocks)


def copy_ids(
    copies: Iterable[Any], retained: Iterable[Any]
) -> tuple[Sequence[tuple[int, int]], Sequence[int]]:
    """``take_kv_cache_block_copies``' answer as ids: (source, destination) pairs, and the
    retained blocks the scheduler frees once the copies ran."""
    return (
        tuple((c.src_block_id, c.dst_block_id) for c in copies),
        tuple(b.block_id for b in retained),
    )


def group_annotation(specs: Sequence[KVCacheSpec], group: int) -> tuple[str, int | None]:
    """The spec kind and sliding window vLLM 0.33's ``KVCacheManager.take_events`` stamps on a
    ``BlockStored`` of ``group`` (kvpool's attention types are named as vLLM's kinds)."""
    spec = specs[group]
    window = spec.sliding_window if spec.attention is AttentionType.SLIDING_WINDOW else None
    return spec.attention.value, window


def without_annotation(event: KVCacheEvent, specs: Sequence[KVCacheSpec]) -> KVCacheEvent:
    """A manager's event as the protocol's (pool events): a ``BlockStored`` whose annotation is
    its group's spec loses it; one annotated otherwise, or not at all, keeps what it has, so
    it differs from the model's and the machine reports it."""
    if not isinstance(event, BlockStored) or not 0 <= event.group_idx < len(specs):
        return event
    stamped = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
    if stamped != group_annotation(specs, event.group_idx):
        return event
    return replace(event, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)


def offload_ids(offloads: Any) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """``take_boundary_state_offloads``' answer as plain ints: per request id, each
    (group, block id, boundary tokens), in the manager's order."""
    return {
        str(rid): tuple((int(g), int(b), int(n)) for g, b, n in entries)
        for rid, entries in offloads.items()
    }


class SchedulerCalls:
    """The rest of vLLM 0.33's scheduler calls (``OPERATIONS_SCHEDULER``) on ``self.manager``,
    answered as the protocol's ids.

    An adapter turns the protocol's request into what its manager reads
    (``caller_request``) and may note each lookup (``looked_up``: vLLM records hit
    statistics apart from the lookup).
    """

    manager: Any

    def caller_request(self, request: Request) -> Any:
        return request

    def looked_up(self, request: Any, num_tokens: int) -> None:
        """A lookup for ``request`` found ``num_tokens``; nothing to note by default."""

    def pop_blocks_for_free(self, request: Request) -> Sequence[int]:
        popped = self.manager.pop_blocks_for_free(self.caller_request(request))
        return tuple(b.block_id for b in popped)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        self.manager.remove_skipped_blocks(request_id, processed_computed_tokens)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> Blocks:
        ids = self.manager.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)
        return tuple(tuple(g) for g in ids)

    def get_computed_blocks_for_connector(self, request: Request) -> tuple[Blocks, int, int, bool]:
        caller = self.caller_request(request)
        blocks, num_tokens, boundary, diverged = self.manager.get_computed_blocks_for_connector(
            caller
        )
        self.looked_up(caller, num_tokens)
        return block_ids(blocks), num_tokens, int(boundary), bool(diverged)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.manager.record_blocks_for_zeroing(request_id, start_token)

    def take_boundary_state_offloads(self) -> Mapping[str, Sequence[tuple[int, int, int]]]:
        return offload_ids(self.manager.take_boundary_state_offloads())

    def finalize_partial_tail_offloads(self, request: Request) -> Sequence[tuple[int, int, int]]:
        tails = self.manager.finalize_partial_tail_offloads(self.caller_request(request))
        return tuple((int(g), int(b), int(n)) for g, b, n in tails)


def hisparse_view(device: Any, host: Any, coordinator: Any) -> HiSparseView:
    """What the HiSparse machine compares, read from a manager with vLLM 0.33's HiSparse API:
    the device and host pools (``device``, ``host``) and the coordinator
    (``get_hisparse_coordinator``'s, or kvpool.impl's view of its own)."""
    hot: set[str] = set()
    for manager in coordinator.hot_managers:
        hot |= set(manager.hot_required)
    return HiSparseView(
        device_blocks=tuple((b.ref_cnt, b.block_hash is not None) for b in device.blocks),
        device_free=tuple(b.block_id for b in device.free_block_queue.get_all_free_blocks()),
        host_blocks=tuple((b.ref_cnt, b.block_hash is not None) for b in host.blocks),
        host_free=tuple(b.block_id for b in host.free_block_queue.get_all_free_blocks()),
        hot_required=frozenset(hot),
        copies=tuple(sorted(tuple(b.block_id for b in bs) for bs in coordinator.copies.values())),
        pending_work=bool(coordinator.has_pending_work()),
        pending_reclamation=bool(coordinator.has_pending_reclamation()),
        books={
            r: (
                frozenset(s.valid_pages),
                s.ready_prefix_pages,
                dict(s.pending_pages),
                frozenset(s.pinned_clean),
                s.synced_pages,
            )
            for r, s in coordinator.request_states.items()
        },
    )
