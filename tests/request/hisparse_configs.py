"""HiSparse configurations for kvpool.impl's manager without vLLM: classes named as vLLM
0.33.0's (the manager reads specs by class name and groups by ``role``), laid out as vLLM's
own tests lay them out (``make_hisparse_kv_cache_config`` in
``tests/v1/core/test_prefix_caching.py``: source, indexer, resident, hot, block size 16)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.impl import KVCacheManager
from kvpool.impl.hisparse import HiSparseCoordinator
from kvpool.model.request import Request, new_request

PAGE = 16


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int


@dataclass(frozen=True)
class HiSparseResidentSpec:
    block_size: int


@dataclass(frozen=True)
class HiSparseHotSpec:
    block_size: int
    blocks_per_request: int = 2


@dataclass
class Group:
    kv_cache_spec: Any
    role: str = "default"
    host_resident: bool = False
    is_eagle_group: bool = False


@dataclass
class Config:
    num_blocks: int
    kv_cache_groups: list[Group] = field(default_factory=list)
    hisparse_host_num_blocks: Any = None
    prefix_cache_retention_interval: Any = None


def groups(num_resident_groups: int = 1, page: int = PAGE) -> list[Group]:
    """Source, indexer, then (resident, hot) pairs."""
    out = [
        Group(FullAttentionSpec(page), "hisparse_source", host_resident=True),
        Group(FullAttentionSpec(page), "hisparse_indexer"),
    ]
    for _ in range(num_resident_groups):
        out += [Group(HiSparseResidentSpec(page)), Group(HiSparseHotSpec(page))]
    return out


def make_manager(
    num_blocks: int = 32,
    host_num_blocks: int = 16,
    *,
    max_model_len: int = 128,
    enable_caching: bool = True,
    num_resident_groups: int = 1,
    **kwargs: Any,
) -> KVCacheManager:
    config = Config(num_blocks, groups(num_resident_groups), host_num_blocks)
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
        hash_block_size=PAGE,
        **kwargs,
    )


def request(request_id: str, tokens: list[int]) -> Request:
    return new_request(request_id, tokens, PAGE)


class Finished:
    """A request that says it has finished (vLLM's ``Request.is_finished()``)."""

    def __init__(self, inner: Request) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def is_finished(self) -> bool:
        return True


def coordinator_of(manager: KVCacheManager) -> HiSparseCoordinator:
    coordinator = manager.hisparse
    assert coordinator is not None
    return coordinator


def fingerprint(manager: KVCacheManager) -> tuple[Any, ...]:
    """Everything the HiSparse manager holds: both pools, every table, the coordinator."""
    c = coordinator_of(manager)
    host = manager.host_block_pool
    assert host is not None
    return (
        manager.block_pool.snapshot(),
        host.snapshot(),
        tuple(m.table() for m in manager.managers),
        tuple(sorted((r, repr(s)) for r, s in c.request_states.items())),
        tuple(
            sorted(
                (t, p.request_id, p.page, p.expected, p.completions, p.enqueue_applied)
                for t, p in c.pending_spills.items()
            )
        ),
        tuple(c.spills_to_send),
        c.next_spill_id,
        c.max_spill_pages,
        tuple(sorted((k, tuple(b.block_id for b in v)) for k, v in c.copies.items())),
        tuple(tuple(sorted(h.hot_required)) for h in c.hot_managers),
        tuple(
            tuple(
                sorted(
                    (r, tuple(sorted((p, b.block_id) for p, b in ch.items())))
                    for r, ch in m.residency_changes.items()
                )
            )
            for m in c.resident_managers
        ),
        tuple(sorted(c._resident_requests)),
        tuple(sorted((b, tuple(sorted(o))) for b, o in c._owners.items())),
    )
