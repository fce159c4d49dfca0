"""HiSparse's hit search and ``allocate_slots`` (docs/hisparse.md, "Admission").

The hit: the source group searches the **host** pool, the indexer groups the device
pool, the resident and hot groups nothing (not prefix-cacheable). The hit is the
shorter; the source keeps its longer hit (``retains_longer_hit``,
``HybridKVCacheCoordinator.find_longest_cache_hit``, vLLM 0.33.0) and
``allocate_slots`` cuts it to the tokens used (``KVCacheManager.allocate_slots``,
``retained_hit_group_ids``).

The counts (``get_num_blocks_to_allocate`` of each manager, vLLM 0.33.0
``vllm/v1/core/single_type_kv_cache_manager.py``): the source's full-attention count is
compared with the host pool's free blocks, costing no device block, or the sentinel
``num_blocks + 1`` when the host cannot back it; a resident group counts its pages,
capped at the admission window under ``full_sequence_must_fit``; a hot group counts its
missing region when the request resumes a host prefix or is ``hot_required``.

Refused by name, before anything changes: a hit (every hit reaches the host tier, since
the source takes part in it; slice 3) and external tokens (slice 4). A hot region is
allocated (slice 2) when the request is ``hot_required``.
"""

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import kvpool.model.pool as pool_ops
import kvpool.model.single_type as single
from kvpool.model.eagle import cacheable_tokens
from kvpool.model.errors import HiSparseNotModelled
from kvpool.model.hisparse_core import (
    Tiers,
    apply_reuses,
    device_pool,
    on_host,
    publish_when_ready,
)
from kvpool.model.request import Request
from kvpool.model.state import BlockHash

Blocks = tuple[tuple[int, ...], ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def find_hit(
    t: Tiers, block_hashes: Sequence[BlockHash], max_length: int
) -> tuple[Blocks, int, int]:
    """The hit per group, its length, and how far past it the longest search reached.

    Searches in group order (the source on the host pool, the indexers together on the
    device pool), each capped by the length found so far.
    """
    layout = t.layout
    m = t.managers
    spec = m.specs[layout.source]
    hits: dict[int, tuple[int, ...]] = {}
    length = max_length
    longest = 0
    kinds: list[tuple[int, ...]] = []
    for g in range(len(m.specs)):
        if g == layout.source:
            kinds.append((g,))
        elif g in layout.indexers and g == layout.indexers[0]:
            kinds.append(layout.indexers)
    for ids in kinds:
        pool = t.host if ids == (layout.source,) else m.pool
        found = single.find_longest_cache_hit(pool, spec, block_hashes, length, list(ids))
        length = len(found[0]) * spec.block_size
        longest = max(longest, length)
        hits.update(zip(ids, found, strict=True))
    blocks = tuple(
        hits.get(g, ()) if g == layout.source else hits.get(g, ())[: _cdiv(length, spec.block_size)]
        for g in range(len(m.specs))
    )
    return blocks, length, longest - length


def count(
    t: Tiers,
    request_id: str,
    num_tokens: int,
    num_local_computed_tokens: int,
    apply_admission_cap: bool,
) -> int:
    """Device blocks giving the request ``num_tokens`` slots takes, the sentinel included."""
    layout = t.layout
    m = t.managers
    size = layout.block_size
    needed = 0
    host_count = single.get_num_blocks_to_allocate(
        replace(m, pool=t.host), layout.source, request_id, num_tokens, ()
    )
    if host_count > pool_ops.get_num_free_blocks(t.host):
        needed += m.pool.config.num_blocks + 1
    for g in layout.indexers:
        needed += single.get_num_blocks_to_allocate(m, g, request_id, num_tokens, ())
    for g in layout.residents:
        existing = len(m.tables[g].req_to_blocks.get(request_id, ()))
        host_pages = _cdiv(num_local_computed_tokens, size)
        required = _cdiv(num_tokens, size)
        if apply_admission_cap:
            required = min(required, layout.max_admission_pages)
        needed += max(required - max(existing, host_pages), 0)
    for g, per_request in zip(layout.hots, layout.blocks_per_request, strict=True):
        table = m.tables[g]
        resumes = num_local_computed_tokens > 0 and request_id not in table.num_cached_block
        if resumes or request_id in t.hs.hot_required:
            needed += max(per_request - len(table.req_to_blocks.get(request_id, ())), 0)
    return needed


def allocate(
    t: Tiers,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    hits: Blocks,
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    full_sequence_must_fit: bool,
    num_external_computed_tokens: int,
    reserved_blocks: int,
    max_model_len: int,
    scheduler_block_size: int,
) -> tuple[Tiers, Blocks | None]:
    """``allocate_slots`` of a HiSparse manager (arguments already checked), or None."""
    layout = t.layout
    m = t.managers
    rid = request.request_id
    ext = num_external_computed_tokens
    size = layout.block_size
    # the source keeps only the prefix the local and external hits cover
    kept = _cdiv(num_new_computed_tokens + ext, size)
    hits = tuple(h[:kept] if g == layout.source else h for g, h in enumerate(hits))
    # Verify that no hit and no external token reaches the host tier (slices 3 and 4)
    if num_new_computed_tokens > 0 or any(hits):
        raise HiSparseNotModelled("a hit on the HiSparse host tier: not modelled yet (slice 3)")
    if ext > 0:
        raise HiSparseNotModelled("external tokens beside HiSparse: not modelled yet (slice 4)")
    num_local = request.num_computed_tokens
    total = min(num_local, max_model_len)
    free = pool_ops.get_num_free_blocks(m.pool)
    if full_sequence_must_fit:
        full = min(request.num_tokens, max_model_len)
        if count(t, rid, full, num_local, apply_admission_cap=True) > free:
            return t, None
    main = total + num_new_tokens
    slots = min(main + num_lookahead_tokens, max_model_len)
    if count(t, rid, slots, num_local, apply_admission_cap=False) > free - reserved_blocks:
        return t, None
    for g in range(len(m.specs)):
        if g == layout.source:
            t, _ = on_host(
                t,
                partial(
                    single.save_new_computed_blocks, group=g, request_id=rid, new_computed_blocks=()
                ),
            )
        else:
            managers, _ = single.save_new_computed_blocks(t.managers, g, rid, ())
            t = replace(t, managers=managers)
    new_blocks: list[tuple[int, ...]] = []
    for g in range(len(m.specs)):
        if g == layout.source:
            t, new = on_host(
                t, partial(single.allocate_new_blocks, group=g, request_id=rid, num_tokens=slots)
            )
        elif g in layout.hots:
            t, new = _allocate_hot(t, g, rid)
        else:
            managers, new = single.allocate_new_blocks(t.managers, g, rid, slots)
            t = apply_reuses(replace(t, managers=managers))
        new_blocks.append(new)
    if t.managers.pool.config.enable_caching and not delay_cache_blocks:
        to_cache = min(total + num_new_tokens, request.num_tokens)
        reprefillable = layout.num_reprefillable_tokens
        cacheable = cacheable_tokens(
            len(m.specs), size, scheduler_block_size, False, False, reprefillable, to_cache
        )
        for g in range(len(m.specs)):
            if g == layout.source:
                t = publish_when_ready(t, request, cacheable)
            elif g in layout.indexers:
                managers, _ = single.cache_blocks(t.managers, g, request, cacheable)
                t = replace(t, managers=managers)
    return t, tuple(new_blocks)


def _allocate_hot(t: Tiers, group: int, request_id: str) -> tuple[Tiers, tuple[int, ...]]:
    """The hot group's allocation: the missing part of the region, only for a request that
    is ``hot_required`` (``HiSparseHotManager.allocate_new_blocks``, vLLM 0.33.0). The
    region's blocks come from the device pool, so a reuse they cause is applied at once."""
    per_request = t.layout.blocks_per_request[t.layout.hots.index(group)]
    table = t.managers.tables[group]
    held = table.req_to_blocks.get(request_id, ())
    missing = per_request - len(held)
    if request_id not in t.hs.hot_required or missing <= 0:
        return t, ()
    t, new = device_pool(t, partial(pool_ops.get_new_blocks, num_blocks=missing))
    table = t.managers.tables[group]
    table = replace(table, req_to_blocks={**table.req_to_blocks, request_id: (*held, *new)})
    tables = (*t.managers.tables[:group], table, *t.managers.tables[group + 1 :])
    return replace(t, managers=replace(t.managers, tables=tables)), tuple(new)
