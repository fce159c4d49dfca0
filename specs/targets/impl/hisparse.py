"""kvpool.impl's HiSparse manager behind the request layer's HiSparse protocol.

``ManagerTargetHiSparse`` (``kvpool.specs.request.target``) over ``kvpool.impl``'s public
API: the manager is built from a configuration shaped as vLLM 0.33.0's (the impl reads a
group's role and its spec's class name, as ``vllm/v1/kv_cache_interface.py`` names them),
and the coordinator's calls go through ``kvpool.impl.get_hisparse_coordinator``'s view,
as vLLM's connector reaches ``vllm/v1/hisparse/coordinator.py``. Blocks handed out are
named by pool (``("CPU", id)`` for the host pool's), because ids are per pool.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.impl import get_hisparse_coordinator
from kvpool.impl.block import KVCacheBlock
from kvpool.impl.hisparse_view import HiSparseCoordinatorView
from kvpool.impl.manager import KVCacheManager
from kvpool.impl.pool import BlockPool
from kvpool.model.hisparse_layout import HiSparseConfig
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror
from kvpool.model.request import Request
from kvpool.specs.request.target import HiSparseView, ManagerSetup, PoolBlock
from kvpool.specs.targets.manager_api import hisparse_view

HOST = "CPU"
DEVICE = "GPU"

# The spec classes are named as vLLM 0.33.0's: the impl tells a group's kind by that name


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int


@dataclass(frozen=True)
class HiSparseResidentSpec:
    block_size: int


@dataclass(frozen=True)
class HiSparseHotSpec:
    block_size: int
    blocks_per_request: int


@dataclass(frozen=True)
class KVCacheGroupSpec:
    kv_cache_spec: Any
    role: str = "default"
    host_resident: bool = False


@dataclass(frozen=True)
class HiSparseKVCacheConfig:
    """vLLM's ``KVCacheConfig`` with ``hisparse_host_num_blocks``, as the impl reads it."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = field(default_factory=tuple)
    hisparse_host_num_blocks: int | None = None
    prefix_cache_retention_interval: int | None = None


def hisparse_config(setup: ManagerSetup, roles: HiSparseConfig) -> HiSparseKVCacheConfig:
    """The configuration vLLM 0.33.0's tests build (``make_hisparse_kv_cache_config`` in
    ``tests/v1/core/test_prefix_caching.py``) for ``setup``'s groups and roles."""
    hots = dict(roles.hot_groups)
    groups = []
    for g, spec in enumerate(setup.specs):
        size = spec.block_size
        if g in roles.source_groups:
            group = KVCacheGroupSpec(FullAttentionSpec(size), "hisparse_source", True)
        elif g in roles.indexer_groups:
            group = KVCacheGroupSpec(FullAttentionSpec(size), "hisparse_indexer")
        elif g in roles.resident_groups:
            group = KVCacheGroupSpec(HiSparseResidentSpec(size))
        elif g in hots:
            group = KVCacheGroupSpec(HiSparseHotSpec(size, hots[g]))
        else:  # the impl refuses a group of no role by name
            group = KVCacheGroupSpec(FullAttentionSpec(size))
        groups.append(group)
    return HiSparseKVCacheConfig(setup.num_blocks, tuple(groups), roles.host_num_blocks)


class _Finished:
    """The request, saying it has finished (vLLM's ``Request.is_finished()``, which the
    impl reads in ``free`` and ``pop_blocks_for_free``)."""

    def __init__(self, inner: Request) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def is_finished(self) -> bool:
        return True


class HiSparseCalls:
    """The HiSparse half of the impl's manager target (``ManagerTargetHiSparse``)."""

    manager: KVCacheManager
    _held: dict[PoolBlock, list[KVCacheBlock]]
    """Blocks popped or pressed and not yet freed, by pool and id (a block popped twice is
    held twice): the impl, as vLLM, frees block objects, each into its own pool."""

    def coordinator(self) -> HiSparseCoordinatorView:
        """The coordinator the calls go through (a test may hand out a modified one)."""
        return get_hisparse_coordinator(self.manager)

    def _host(self) -> BlockPool:
        return self.coordinator().get_host_block_pool()

    def _pool(self, pool: str) -> BlockPool:
        return self._host() if pool == HOST else self.manager.block_pool

    def _name(self, block: KVCacheBlock) -> PoolBlock:
        host = self._host().blocks
        on_host = block.block_id < len(host) and host[block.block_id] is block
        return (HOST if on_host else DEVICE, block.block_id)

    def _keep(self, key: PoolBlock, block: KVCacheBlock) -> None:
        self._held.setdefault(key, []).append(block)

    def _take(self, key: PoolBlock) -> KVCacheBlock:
        held = self._held.get(key)
        if held:
            block = held.pop()
            if not held:
                del self._held[key]
            return block
        return self._pool(key[0]).blocks[key[1]]

    @staticmethod
    def _as(request: Request, finished: bool) -> Any:
        return _Finished(request) if finished else request

    # -- the manager, with whether the request finished ---------------------

    def free_request(self, request: Request, finished: bool) -> None:
        self.manager.free(self._as(request, finished))

    def pop_pool_blocks_for_free(self, request: Request, finished: bool) -> Sequence[PoolBlock]:
        named = []
        for block in self.manager.pop_blocks_for_free(self._as(request, finished)):
            key = self._name(block)
            self._keep(key, block)
            named.append(key)
        return tuple(named)

    def free_pool_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        # the pool hands each block to the pool it belongs to
        self.manager.block_pool.free_blocks([self._take(key) for key in blocks])

    # -- the coordinator -----------------------------------------------------

    def advance_scheduled(self, scheduled: Sequence[tuple[str, int]]) -> None:
        self.coordinator().advance_scheduled(list(scheduled))

    def build_offload_command(self) -> Sequence[PageTransfer]:
        return tuple(self.coordinator().build_offload_command().page_transfers)

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        self.coordinator().update_spills(dict(enqueued), dict(completed))

    def build_row_mirrors(self, spans: Sequence[tuple[str, int, int]]) -> Sequence[RowMirror]:
        return tuple(self.coordinator().build_row_mirrors(list(spans)))

    def all_context_pages_resident(self, spans: Sequence[tuple[str, int, int]]) -> bool:
        return self.coordinator().all_context_pages_resident(list(spans))

    def take_residency_updates(self, request_ids: Sequence[str]) -> Mapping[str, ResidencyUpdate]:
        return {
            r: ResidencyUpdate(pages=tuple(u.pages), block_ids=tuple(tuple(g) for g in u.block_ids))
            for r, u in self.coordinator().take_residency_updates(list(request_ids)).items()
        }

    def require_hot(self, request_id: str) -> None:
        self.coordinator().require_hot(request_id)

    def press_pool(self, pool: str, count: int) -> Sequence[int]:
        taken = self._pool(pool).get_new_blocks(count)
        for block in taken:
            self._keep((pool, block.block_id), block)
        return tuple(b.block_id for b in taken)

    def release_pool(self, pool: str, block_ids: Sequence[int]) -> None:
        self._pool(pool).free_blocks([self._take((pool, b)) for b in block_ids])

    def hisparse_view(self) -> HiSparseView:
        return hisparse_view(self.manager.block_pool, self._host(), self.coordinator())
