"""vLLM 0.33's HiSparse manager behind the request layer's HiSparse protocol.

``ManagerTargetHiSparse`` (``kvpool.specs.request.target``) over vLLM's ``KVCacheManager``
built with HiSparse's roles, as vLLM 0.33.0's own tests build it
(``make_hisparse_kv_cache_config`` and ``make_kv_cache_manager`` in
``tests/v1/core/test_prefix_caching.py``): the source group host-resident with the role
``HISPARSE_SOURCE``, the indexer groups ``HISPARSE_INDEXER``, each resident group a
``HiSparseResidentSpec`` and each hot group a ``HiSparseHotSpec`` (its KV transfer off), the
host pool's size in ``KVCacheConfig.hisparse_host_num_blocks``. ``get_hisparse_coordinator``
runs right after construction, as ``bind_kv_cache_manager`` does in an engine
(``vllm/v1/hisparse/coordinator.py``), and the coordinator's methods are called directly
(docs/hisparse.md, "How the vLLM side is driven").

Events come back as the model's, with vLLM's hashes standing in for the model's (the
machine compares HiSparse events by kind, medium, size and tokens: the two hash apart).
"""

import importlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvpool.model.errors import NoNewTokens
from kvpool.model.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror
from kvpool.model.manager import Blocks, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.specs.errors import TargetError
from kvpool.specs.request.target import HiSparseView, ManagerSetup, PoolBlock
from kvpool.specs.targets.manager_api import block_ids, hisparse_view
from kvpool.specs.targets.vllm.hasher import VllmRequests, find_hasher

HOST = "CPU"
DEVICE = "GPU"


def _bytes(value: Any) -> bytes:
    if isinstance(value, int):
        return value.to_bytes(8, "big", signed=False) if value >= 0 else str(value).encode()
    return bytes(value)


def _event(event: Any) -> KVCacheEvent:
    """One of vLLM's events as the model's, with vLLM's hashes (not the model's)."""
    name = type(event).__name__
    if name == "BlockStored":
        return BlockStored(
            block_hashes=tuple(_bytes(h) for h in event.block_hashes),
            parent_block_hash=None,
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
            extra_keys=None,
            group_idx=getattr(event, "group_idx", 0) or 0,
        )
    if name == "BlockRemoved":
        return BlockRemoved(
            block_hashes=tuple(_bytes(h) for h in event.block_hashes),
            medium=event.medium,
            group_idx=getattr(event, "group_idx", 0) or 0,
        )
    return AllBlocksCleared()


def build_hisparse_manager(setup: ManagerSetup, manager_class: Any = None) -> Any:
    """vLLM's manager for ``setup`` (``setup.hisparse`` set), its coordinator bound."""
    roles = setup.hisparse
    assert roles is not None
    torch = importlib.import_module("torch")
    manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    coordinator_module = importlib.import_module("vllm.v1.hisparse.coordinator")
    role = interface.KVCacheGroupRole
    hots = dict(roles.hot_groups)
    groups = []
    for g, spec in enumerate(setup.specs):
        size = spec.block_size
        full = interface.FullAttentionSpec(
            block_size=size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        if g in roles.source_groups:
            group = interface.KVCacheGroupSpec(
                [f"source.{g}"], full, role=role.HISPARSE_SOURCE, host_resident=True
            )
        elif g in roles.indexer_groups:
            group = interface.KVCacheGroupSpec([f"indexer.{g}"], full, role=role.HISPARSE_INDEXER)
        elif g in roles.resident_groups:
            group = interface.KVCacheGroupSpec(
                [f"resident.{g}"],
                interface.HiSparseResidentSpec(block_size=size, page_size=4 * size),
            )
        elif g in hots:
            group = interface.KVCacheGroupSpec(
                [f"hot.{g}"],
                interface.HiSparseHotSpec(
                    block_size=size, page_size=4 * size, blocks_per_request=hots[g]
                ),
                enable_kv_transfer=False,
            )
        else:
            raise TargetError(f"group {g} has no HiSparse role")
        groups.append(group)
    config = interface.KVCacheConfig(
        num_blocks=setup.num_blocks,
        hisparse_host_num_blocks=roles.host_num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )
    cls = manager_class or manager_module.KVCacheManager
    manager = cls(
        config,
        max_model_len=setup.max_model_len,
        max_in_flight_tokens=setup.max_in_flight_tokens,
        enable_caching=setup.enable_caching,
        hash_block_size=setup.hash_block_size,
        num_prefill_lookahead=setup.num_prefill_lookahead,
        enable_kv_cache_events=setup.enable_events,
        log_stats=setup.log_stats,
        scheduler_block_size=setup.scheduler_block_size or setup.hash_block_size,
    )
    coordinator_module.get_hisparse_coordinator(manager)
    return manager


class VllmHiSparseTarget:
    """vLLM's HiSparse manager and its coordinator (``ManagerTargetHiSparse``)."""

    def __init__(self, setup: ManagerSetup, manager_class: Any = None) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        if setup.hisparse is None:
            raise TargetError("the HiSparse adapter needs ManagerSetup.hisparse")
        try:
            manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
            coordinator_module = importlib.import_module("vllm.v1.hisparse.coordinator")
            status = importlib.import_module("vllm.v1.request").RequestStatus
        except Exception as error:  # ImportError, or a dependency failing at import
            raise TargetError(
                f"vLLM's HiSparse coordinator cannot be imported: {error!r}"
            ) from error
        logging.getLogger("vllm").setLevel(logging.ERROR)
        cls = manager_class or manager_module.KVCacheManager
        hasher = find_hasher(cls)
        if hasher is None:
            raise TargetError("vLLM has no get_request_block_hasher")
        self._status = status
        self._requests = VllmRequests(hasher, status.RUNNING)
        self.setup = setup
        self.manager = build_hisparse_manager(setup, cls)
        self.coordinator = coordinator_module.get_hisparse_coordinator(self.manager)
        self._held: dict[PoolBlock, list[Any]] = {}
        """Blocks popped or pressed and not yet freed, by pool and id (a block popped twice
        is held twice): vLLM frees block objects, each into its own pool."""

    def _request(self, request: Request) -> Any:
        return self._requests.get(request)

    def _host(self) -> Any:
        return self.coordinator.get_host_block_pool()

    def _pool_of(self, block: Any) -> str:
        host = self._host()
        on_host = block.block_id < len(host.blocks) and host.blocks[block.block_id] is block
        return HOST if on_host else DEVICE

    def _hold(self, blocks: Sequence[Any]) -> tuple[PoolBlock, ...]:
        named = []
        for block in blocks:
            key = (self._pool_of(block), block.block_id)
            self._held.setdefault(key, []).append(block)
            named.append(key)
        return tuple(named)

    def _take(self, key: PoolBlock) -> Any:
        held = self._held.get(key)
        if held:
            block = held.pop()
            if not held:
                del self._held[key]
            return block
        pool = self._host() if key[0] == HOST else self.manager.block_pool
        return pool.blocks[key[1]]

    # -- the manager -----------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        blocks, num_tokens, *_ = self.manager.get_computed_blocks(self._request(request))
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
    ) -> Blocks | None:
        if new_computed_blocks is not None and any(new_computed_blocks):
            raise TargetError("the HiSparse machine admits no hits (slice 1: no host-tier hit)")
        try:
            blocks = self.manager.allocate_slots(
                self._request(request),
                num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                delay_cache_blocks=delay_cache_blocks,
                full_sequence_must_fit=full_sequence_must_fit,
            )
        except ValueError as error:  # 0.33 says "no new tokens" with a ValueError
            raise NoNewTokens(str(error)) from error
        return None if blocks is None else block_ids(blocks)

    def free(self, request: Request) -> None:
        self.free_request(request, False)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(self._request(request), num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.manager.evict_blocks(set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int] | None:
        return None

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        return None  # the HiSparse machine does not compare stats

    def usage(self) -> float:
        return float(self.manager.usage)

    def get_block_ids(self, request_id: str) -> Blocks:
        return tuple(tuple(g) for g in self.manager.get_block_ids(request_id))

    def take_events(self) -> Sequence[KVCacheEvent]:
        return tuple(_event(e) for e in self.manager.take_events())

    def num_free_blocks(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())

    def free_request(self, request: Request, finished: bool) -> None:
        duck = self._request(request)
        duck.status = self._status.FINISHED_STOPPED if finished else self._status.PREEMPTED
        self.manager.free(duck)

    def pop_pool_blocks_for_free(self, request: Request, finished: bool) -> Sequence[PoolBlock]:
        duck = self._request(request)
        duck.status = self._status.FINISHED_STOPPED if finished else self._status.PREEMPTED
        return self._hold(self.manager.pop_blocks_for_free(duck))

    def free_pool_blocks(self, blocks: Sequence[PoolBlock]) -> None:
        # BlockPool.free_blocks hands each block to its own pool (block.pool)
        self.manager.block_pool.free_blocks([self._take(key) for key in blocks])

    # -- the coordinator ---------------------------------------------------

    def advance_scheduled(self, scheduled: Sequence[tuple[str, int]]) -> None:
        self.coordinator.advance_scheduled(list(scheduled))

    def build_offload_command(self) -> Sequence[PageTransfer]:
        command = self.coordinator.build_offload_command()
        return tuple(
            PageTransfer(
                transfer_id=t.transfer_id,
                host_block_id=t.host_block_id,
                resident_block_ids=tuple(t.resident_block_ids),
                after_forward=t.after_forward,
                restore=t.restore,
            )
            for t in command.page_transfers
        )

    def update_spills(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> None:
        self.coordinator.update_spills(dict(enqueued), dict(completed))

    def build_row_mirrors(self, spans: Sequence[tuple[str, int, int]]) -> Sequence[RowMirror]:
        return tuple(
            RowMirror(
                source_starts=tuple(m.source_starts),
                destination_start=m.destination_start,
                num_rows=m.num_rows,
            )
            for m in self.coordinator.build_row_mirrors(list(spans))
        )

    def all_context_pages_resident(self, spans: Sequence[tuple[str, int, int]]) -> bool:
        return bool(self.coordinator.all_context_pages_resident(list(spans)))

    def take_residency_updates(self, request_ids: Sequence[str]) -> Mapping[str, ResidencyUpdate]:
        return {
            r: ResidencyUpdate(pages=tuple(u.pages), block_ids=tuple(tuple(g) for g in u.block_ids))
            for r, u in self.coordinator.take_residency_updates(list(request_ids)).items()
        }

    def require_hot(self, request_id: str) -> None:
        for hot in self.coordinator.hot_managers:
            hot.require_hot(request_id)

    def press_pool(self, pool: str, count: int) -> Sequence[int]:
        chosen = self._host() if pool == HOST else self.manager.block_pool
        taken = chosen.get_new_blocks(count)
        for block in taken:
            self._held.setdefault((pool, block.block_id), []).append(block)
        return tuple(b.block_id for b in taken)

    def release_pool(self, pool: str, block_ids: Sequence[int]) -> None:
        chosen = self._host() if pool == HOST else self.manager.block_pool
        chosen.free_blocks([self._take((pool, b)) for b in block_ids])

    def hisparse_view(self) -> HiSparseView:
        return hisparse_view(self.manager.block_pool, self._host(), self.coordinator)
