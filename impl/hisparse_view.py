"""``get_hisparse_coordinator``: the HiSparse coordinator under vLLM 0.33.0's names.

vLLM's scheduler connector and vLLM's own tests reach HiSparse through
``vllm.v1.hisparse.coordinator.get_hisparse_coordinator(manager)``. For a
``kvpool.impl.KVCacheManager`` the same call (``kvpool.impl.get_hisparse_coordinator``)
returns :class:`HiSparseCoordinatorView`: the coordinator the manager built, with vLLM's
attribute and method names, and its answers in the shapes vLLM's callers read (lists where
vLLM's records hold lists). The view hands out the manager's own group objects
(``resident_managers``, ``hot_managers``, ``host_manager``) and pools, as vLLM's coordinator
does: what a caller does through them is the manager's own operations.

Not answered (docs/hisparse.md, "The 55 tests"): the coordinator's internal counting
(``coordinator.get_num_blocks_to_allocate``), and the paths of later slices
(``complete_host_import``, ``commit_computed_blocks``): those raise HiSparseNotModelled.
"""

from __future__ import annotations

from typing import Any

from kvpool.impl.hisparse import HiSparseCoordinator, RequestState
from kvpool.impl.hisparse_groups import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from kvpool.impl.pool import BlockPool
from kvpool.model.errors import HiSparseNotModelled, InvalidArgument, InvalidHiSparseLayout
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror


class OffloadCommand:
    """vLLM's ``SparseKVOffloadCommand``: this step's transfers, a list."""

    __slots__ = ("page_transfers",)

    def __init__(self, page_transfers: list[PageTransfer]) -> None:
        self.page_transfers = page_transfers

    def __repr__(self) -> str:
        return f"OffloadCommand({self.page_transfers!r})"


class ResidencyUpdateView:
    """vLLM's ``SparseKVResidencyUpdate``: ``pages`` a list, ``block_ids`` a tuple of lists."""

    __slots__ = ("block_ids", "pages")

    def __init__(self, update: ResidencyUpdate) -> None:
        self.pages = list(update.pages)
        self.block_ids = tuple(list(row) for row in update.block_ids)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ResidencyUpdateView)
            and other.pages == self.pages
            and other.block_ids == self.block_ids
        )

    def __hash__(self) -> int:
        return hash((tuple(self.pages), tuple(tuple(r) for r in self.block_ids)))

    def __repr__(self) -> str:
        return f"ResidencyUpdate(pages={self.pages}, block_ids={self.block_ids})"


class HiSparseCoordinatorView:
    """The manager's HiSparse coordinator under vLLM 0.33.0's names (``HiSparseCoordinator``)."""

    __slots__ = ("_coordinator",)

    def __init__(self, coordinator: HiSparseCoordinator) -> None:
        self._coordinator = coordinator

    # ---- state vLLM's callers read --------------------------------------

    @property
    def resident_managers(self) -> tuple[HiSparseResidentManager, ...]:
        return self._coordinator.resident_managers

    @property
    def hot_managers(self) -> tuple[HiSparseHotManager, ...]:
        return self._coordinator.hot_managers

    @property
    def host_manager(self) -> HiSparseSourceManager:
        return self._coordinator.host_manager

    @property
    def host_group_id(self) -> int:
        return self._coordinator.host_manager.kv_cache_group_id

    @property
    def has_host_cache(self) -> bool:
        return True

    @property
    def gpu_pool(self) -> BlockPool:
        return self._coordinator.gpu_pool

    @property
    def transition_watermark(self) -> int:
        return self._coordinator.transition_watermark

    @property
    def max_spill_pages(self) -> int:
        return self._coordinator.max_spill_pages

    @max_spill_pages.setter
    def max_spill_pages(self, value: Any) -> None:
        """Settable, as vLLM's attribute is (its tests lower the spill budget)."""
        # Verify that the budget is a non-negative int
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"max_spill_pages={value!r} must be a non-negative int")
        self._coordinator.max_spill_pages = value

    @property
    def num_reprefillable_tokens(self) -> int:
        return self._coordinator.num_reprefillable_tokens

    @property
    def request_states(self) -> dict[str, RequestState]:
        """Per request, its page bookkeeping (a new dict of the coordinator's states)."""
        return dict(self._coordinator.request_states)

    @property
    def copies(self) -> dict[Any, tuple[Any, ...]]:
        """Published host block's key to the GPU copies of that page (a new dict)."""
        return dict(self._coordinator.copies)

    @property
    def spills_to_send(self) -> list[PageTransfer]:
        """The transfers planned and not yet handed out (a new list)."""
        return list(self._coordinator.spills_to_send)

    @property
    def next_spill_id(self) -> int:
        return self._coordinator.next_spill_id

    def get_host_block_pool(self) -> BlockPool:
        return self._coordinator.host_pool

    # ---- operations -----------------------------------------------------

    def advance_scheduled(self, requests: Any) -> None:
        self._coordinator.advance_scheduled(requests)

    def plan_prefix_materialization(self, request_id: Any, num_computed_tokens: Any) -> None:
        self._coordinator.plan_prefix_materialization(request_id, num_computed_tokens)

    def update_residency(self, request_id: Any) -> None:
        self._coordinator.update_residency(request_id)

    def require_hot(self, request_id: Any) -> None:
        self._coordinator.require_hot(request_id)

    def build_offload_command(self) -> OffloadCommand:
        return OffloadCommand(list(self._coordinator.build_offload_command()))

    def update_spills(self, enqueued_counts: Any, completed_counts: Any) -> None:
        self._coordinator.update_spills(enqueued_counts, completed_counts)

    def build_row_mirrors(self, requests: Any) -> tuple[RowMirror, ...]:
        return self._coordinator.build_row_mirrors(requests)

    def all_context_pages_resident(self, requests: Any) -> bool:
        return self._coordinator.all_context_pages_resident(requests)

    def take_residency_updates(self, request_ids: Any) -> dict[str, ResidencyUpdateView]:
        updates = self._coordinator.take_residency_updates(request_ids)
        return {rid: ResidencyUpdateView(update) for rid, update in updates.items()}

    def has_pending_reclamation(self) -> bool:
        return self._coordinator.has_pending_reclamation()

    def has_pending_work(self) -> bool:
        return self._coordinator.has_pending_work()

    def take_host_block_copies(self) -> tuple[Any, ...]:
        """Host copy-on-write copies: none without fine-grained hits (refused beside HiSparse)."""
        return ()

    def release_completed_host_copies(self, dst_block_ids: Any) -> None:
        """Nothing is retained for host copies (none are made), so nothing is released."""
        for block_id in dst_block_ids:
            if type(block_id) is not int:
                raise InvalidArgument(f"block id {block_id!r:.40} is not an int")

    def finish_host_import(self, request_id: Any, *, failed: bool) -> None:
        """A connector's receive finished: no import is ever pending in slice 1 (external
        tokens beside HiSparse are refused), so there is nothing to finish."""
        if not isinstance(request_id, str):
            raise InvalidArgument(f"a request id is a str, not {type(request_id).__name__}")

    def complete_host_import(self, request_id: Any, num_computed_tokens: Any) -> None:
        raise HiSparseNotModelled("host imports (complete_host_import): not modelled yet")

    def commit_computed_blocks(self, request_id: Any, num_host_pages: Any) -> None:
        raise HiSparseNotModelled("host prefix hits (commit_computed_blocks): not modelled yet")

    def __repr__(self) -> str:
        return f"HiSparseCoordinatorView({len(self._coordinator.request_states)} requests)"


def get_hisparse_coordinator(kv_cache_manager: Any) -> HiSparseCoordinatorView:
    """The HiSparse coordinator of a ``kvpool.impl.KVCacheManager``, under vLLM's names; the
    same object on every call. InvalidHiSparseLayout if the manager has no HiSparse groups
    (vLLM: "No HiSparse cache group is configured")."""
    coordinator = getattr(kv_cache_manager, "hisparse", None)
    if not isinstance(coordinator, HiSparseCoordinator):
        raise InvalidHiSparseLayout("no HiSparse cache group is configured")
    view = kv_cache_manager.hisparse_view
    if view is None:
        view = HiSparseCoordinatorView(coordinator)
        kv_cache_manager.hisparse_view = view
    assert isinstance(view, HiSparseCoordinatorView)
    return view
