"""HiSparse's steps over the two pools, shared by the manager's calls and the coordinator's.

Everything here works on ``Tiers``: the group tables with the **device** pool
(``ManagersState.pool``), the **host** pool, the coordinator's books and the layout.
The source group's table holds host block ids; every operation on it runs on the
host pool (``_on_host``), and the host pool's events are moved at once to the end of
the device pool's queue: vLLM 0.33.0's host pool writes into the device pool's queue
(``SharedEventQueueBlockPool``, ``vllm/v1/hisparse/block_pool.py``), so
``take_events`` returns both pools' events in the order they happened.

The device pool's reuse watcher is the value ``WATCHER``. After each device step that
can fire it (an allocation, a reset), the reuses are taken and the coordinator's
``_on_block_reused`` applied: the copy naming the block is dropped, and every page still
reading the block (``owners``) is lost. A step that fires nothing changes nothing here, so
applying the reuses after the step, not inside it, is the same as vLLM's callback.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import kvpool.model.pool as pool_ops
import kvpool.model.single_type as single
from kvpool.model.hisparse_layout import HiSparseLayout
from kvpool.model.hisparse_state import WATCHER, HiSparseState, PageBook, Publication, Transfer
from kvpool.model.hisparse_types import ACTIVE_TAIL_PAGES
from kvpool.model.pinning import unpin_blocks
from kvpool.model.request import Request, cache_request
from kvpool.model.state import NULL_BLOCK_ID, HashKey, PoolState

T = TypeVar("T")


@dataclass(frozen=True)
class Tiers:
    """A HiSparse manager's parts: tables and device pool, host pool, books, layout."""

    managers: single.ManagersState
    host: PoolState
    hs: HiSparseState
    layout: HiSparseLayout


# --------------------------------------------------------------------------
# The two pools
# --------------------------------------------------------------------------


def on_host(
    t: Tiers, step: Callable[[single.ManagersState], tuple[single.ManagersState, T]]
) -> tuple[Tiers, T]:
    """Run a single-type step with the host pool in place of the device pool."""
    m, result = step(replace(t.managers, pool=t.host))
    return _share_events(t, m.pool, replace(m, pool=t.managers.pool)), result


def host_pool(t: Tiers, step: Callable[[PoolState], tuple[PoolState, T]]) -> tuple[Tiers, T]:
    """Run a pool step on the host pool."""
    host, result = step(t.host)
    return _share_events(t, host, t.managers), result


def _share_events(t: Tiers, host: PoolState, m: single.ManagersState) -> Tiers:
    host, events = pool_ops.take_events(host)
    if events:
        device = m.pool
        m = replace(m, pool=replace(device, pending_events=device.pending_events + events))
    return replace(t, managers=m, host=host)


def device_pool(t: Tiers, step: Callable[[PoolState], tuple[PoolState, T]]) -> tuple[Tiers, T]:
    """Run a pool step on the device pool, then apply the reuse watchers it fired."""
    pool, result = step(t.managers.pool)
    return apply_reuses(replace(t, managers=replace(t.managers, pool=pool))), result


def apply_reuses(t: Tiers) -> Tiers:
    """Take the device pool's fired watchers; drop the copy of each reused block
    (``HiSparseCoordinator._on_block_reused``, vLLM 0.33.0)."""
    pool, reuses = pool_ops.take_reuses(t.managers.pool)
    t = replace(t, managers=replace(t.managers, pool=pool))
    for reuse in reuses:
        if reuse.watcher != WATCHER:
            continue
        hs = t.hs
        key = hs.copy_of_block.get(reuse.block_id)
        if key is not None:
            hs = _drop_copy(hs, key)
        readers = hs.owners.get(reuse.block_id, frozenset())
        hs = replace(hs, owners={b: o for b, o in hs.owners.items() if b != reuse.block_id})
        t = replace(t, hs=hs)
        for request_id, page in sorted(readers):
            t = lose_page(t, request_id, page)
    return t


def _set_owner(hs: HiSparseState, block: int, reader: tuple[str, int], add: bool) -> HiSparseState:
    current = hs.owners.get(block, frozenset())
    updated = current | {reader} if add else current - {reader}
    owners = {b: o for b, o in hs.owners.items() if b != block}
    if updated:
        owners[block] = updated
    return replace(hs, owners=owners)


def lose_page(t: Tiers, request_id: str, page: int) -> Tiers:
    """The request stops reading the page from the GPU (``_lose_page``, vLLM 0.33.0): it
    becomes host-only in every resident group, is resent if the worker had it, and the
    request asks for its hot region in every hot group."""
    hs = t.hs
    t = replace(t, hs=replace(hs, resident_marks=hs.resident_marks - {request_id}))
    found = t.hs.books.get(request_id)
    if found is None:
        return t
    hs = t.hs
    for g in t.layout.residents:
        block = resident_page(t, g, request_id, page)
        if block is not None:
            hs = _set_owner(hs, block, (request_id, page), add=False)
    t = replace(t, hs=hs)
    stale = found.stale | {page} if page < found.synced_pages else found.stale
    t = put_book(
        t,
        request_id,
        replace(found, lost=found.lost | {page}, unpinned=found.unpinned - {page}, stale=stale),
    )
    return require_hot(t, request_id)


def require_hot(t: Tiers, request_id: str) -> Tiers:
    """``require_hot`` on every hot group (no hot group: nothing)."""
    if not t.layout.hots:
        return t
    return replace(t, hs=replace(t.hs, hot_required=t.hs.hot_required | {request_id}))


def _drop_copy(hs: HiSparseState, key: HashKey) -> HiSparseState:
    blocks = hs.copies.get(key)
    if blocks is None:
        return hs
    return replace(
        hs,
        copies={k: v for k, v in hs.copies.items() if k != key},
        copy_of_block={b: k for b, k in hs.copy_of_block.items() if b not in blocks},
    )


# --------------------------------------------------------------------------
# Books
# --------------------------------------------------------------------------


def book(t: Tiers, request_id: str) -> tuple[Tiers, PageBook]:
    """The request's book, created empty if it has none (``_get_request_state``)."""
    found = t.hs.books.get(request_id)
    if found is not None:
        return t, found
    new = PageBook(generation=t.hs.next_generation)
    hs = replace(
        t.hs, books={**t.hs.books, request_id: new}, next_generation=t.hs.next_generation + 1
    )
    return replace(t, hs=hs), new


def put_book(t: Tiers, request_id: str, updated: PageBook) -> Tiers:
    return replace(t, hs=replace(t.hs, books={**t.hs.books, request_id: updated}))


def _lost(t: Tiers, request_id: str) -> frozenset[int]:
    found = t.hs.books.get(request_id)
    return frozenset() if found is None else found.lost


def resident_page(t: Tiers, group: int, request_id: str, page: int) -> int | None:
    """The GPU block of a page in a resident group, None when it has none: a null entry of
    the table row, or a lost page (``get_resident_page``)."""
    row = t.managers.tables[group].req_to_blocks.get(request_id)
    if row is None or page >= len(row) or row[page] == NULL_BLOCK_ID:
        return None
    if page in _lost(t, request_id):
        return None
    return row[page]


def can_read_from_host(t: Tiers, request_id: str) -> bool:
    """Whether the request holds its hot region in every hot group (``_can_read_from_host``)."""
    return bool(t.layout.hots) and all(
        len(t.managers.tables[g].req_to_blocks.get(request_id, ())) == per_request
        for g, per_request in zip(t.layout.hots, t.layout.blocks_per_request, strict=True)
    )


def _unpinnable_blocks(t: Tiers, request_id: str, page: int) -> list[int] | None:
    """The page's GPU block in each resident group, None if any group has none or the page
    is in that group's active tail (``_resident_page_blocks``)."""
    blocks: list[int] = []
    for g in t.layout.residents:
        num_pages = len(t.managers.tables[g].req_to_blocks.get(request_id, ()))
        block = resident_page(t, g, request_id, page)
        if page >= num_pages - ACTIVE_TAIL_PAGES or block is None:
            return None
        blocks.append(block)
    return blocks


def unpin_page(t: Tiers, request_id: str, page: int) -> Tiers:
    """Give back a clean page's GPU blocks with ``unpin_blocks``, the request still reading
    them (``_unpin_page``); nothing if the page is dirty, being written back, or has no
    unpinnable block."""
    found = t.hs.books[request_id]
    if page in found.pending or page not in found.valid:
        return t
    blocks = _unpinnable_blocks(t, request_id, page)
    if blocks is None:
        return t
    for block in blocks:
        t = replace(t, hs=_set_owner(t.hs, block, (request_id, page), add=True))
        t, _ = device_pool(t, partial(unpin_blocks, block_ids=[block], watcher=WATCHER))
    found = t.hs.books[request_id]
    return put_book(
        t,
        request_id,
        replace(found, pinned_clean=found.pinned_clean - {page}, unpinned=found.unpinned | {page}),
    )


def unpin_clean_pages(t: Tiers, request_id: str) -> Tiers:
    """Unpin every clean pinned page, tail first (``_unpin_clean_pages``): a prefix loses its
    tail pages before its head, since the pool hands out the earliest unpinned first."""
    for page in sorted(t.hs.books[request_id].pinned_clean, reverse=True):
        t = unpin_page(t, request_id, page)
    return t


# --------------------------------------------------------------------------
# Publication and copies
# --------------------------------------------------------------------------


def publish_when_ready(t: Tiers, request: Request, num_computed_tokens: int) -> Tiers:
    """Record the source group's pending publication, then publish its durable prefix
    (``HiSparseSourceManager.cache_blocks``, ``publish_when_ready``, vLLM 0.33.0)."""
    t, found = book(t, request.request_id)
    publication = Publication(
        request, num_computed_tokens, num_computed_tokens // t.layout.block_size
    )
    t = put_book(t, request.request_id, replace(found, publication=publication))
    return publish_if_ready(t, request.request_id)


def publish_if_ready(t: Tiers, request_id: str) -> Tiers:
    """Cache on the host pool the publication's tokens below the durable prefix
    (``_publish_host_blocks_if_ready``); forget the publication once it is all durable."""
    found = t.hs.books.get(request_id)
    if found is None or found.publication is None:
        return t
    publication = found.publication
    size = t.layout.block_size
    num_tokens = min(publication.num_computed_tokens, found.ready_prefix_pages * size)
    source = t.layout.source
    t, _ = on_host(t, lambda m: single.cache_blocks(m, source, publication.request, num_tokens))
    t = _record_copies(t, request_id, num_tokens)
    if found.ready_prefix_pages >= publication.num_pages:
        t = put_book(t, request_id, replace(t.hs.books[request_id], publication=None))
    return t


def _record_copies(t: Tiers, request_id: str, num_tokens: int) -> Tiers:
    host_blocks = t.managers.tables[t.layout.source].req_to_blocks.get(request_id)
    if not host_blocks:
        return t
    found = t.hs.books[request_id]
    count = min(num_tokens // t.layout.block_size, len(host_blocks))
    for page in range(found.copies_recorded_pages, count):
        if page not in found.pending:
            t = _record_copy(t, request_id, page, host_blocks[page])
    recorded = max(found.copies_recorded_pages, count)
    return put_book(t, request_id, replace(t.hs.books[request_id], copies_recorded_pages=recorded))


def _record_copy(t: Tiers, request_id: str, page: int, host_block: int) -> Tiers:
    """Remember the page's GPU blocks under its host block's hash (``_record_copy``)."""
    key = t.host.blocks[host_block].block_hash
    if host_block == NULL_BLOCK_ID or key is None:
        return t
    blocks: list[int] = []
    for g in t.layout.residents:
        block = resident_page(t, g, request_id, page)
        if block is None:
            return t
        blocks.append(block)
    hs = _drop_copy(t.hs, key)
    hs = replace(
        hs,
        copies={**hs.copies, key: tuple(blocks)},
        copy_of_block={**hs.copy_of_block, **dict.fromkeys(blocks, key)},
    )
    return replace(t, hs=hs)


# --------------------------------------------------------------------------
# Spills
# --------------------------------------------------------------------------


def plan_materialization(t: Tiers, request_id: str, num_computed_tokens: int) -> Tiers:
    """Plan a spill for every sealed, dirty page with a GPU copy in every resident group,
    in page order, within the spill budget (``plan_prefix_materialization``)."""
    num_pages = num_computed_tokens // t.layout.block_size
    t, found = book(t, request_id)
    budget = max(t.layout.max_spill_pages - len(t.hs.to_send), 0)
    for page in range(found.ready_prefix_pages, num_pages):
        if budget == 0:
            break
        current = t.hs.books[request_id]
        if page in current.pending or page in current.valid:
            continue
        if any(resident_page(t, g, request_id, page) is None for g in t.layout.residents):
            continue
        t, planned = plan_transfer(t, request_id, page, after_forward=True)
        if planned:
            budget -= 1
    return t


def plan_transfer(
    t: Tiers, request_id: str, page: int, after_forward: bool, restore: bool = False
) -> tuple[Tiers, bool]:
    """Queue one page transfer, each end held once more until it completes
    (``_plan_page_transfer``); False when the page has no host block or GPU copy."""
    t, found = book(t, request_id)
    if page in found.pending:
        return t, False
    host_blocks = t.managers.tables[t.layout.source].req_to_blocks.get(request_id)
    if host_blocks is None or page >= len(host_blocks) or host_blocks[page] == NULL_BLOCK_ID:
        return t, False
    host_block = host_blocks[page]
    blocks: list[int] = []
    for g in t.layout.residents:
        block = resident_page(t, g, request_id, page)
        if block is None:
            return t, False
        blocks.append(block)
    t, _ = host_pool(t, lambda p: pool_ops.touch(p, [host_block]))
    for block in blocks:
        t, _ = device_pool(t, partial(pool_ops.touch, block_ids=[block]))
    hs = t.hs
    tid = hs.next_transfer_id
    transfer = Transfer(
        tid, found.generation, request_id, page, host_block, tuple(blocks), after_forward, restore
    )
    hs = replace(
        hs,
        transfers={**hs.transfers, tid: transfer},
        to_send=(*hs.to_send, tid),
        next_transfer_id=tid + 1,
    )
    t = replace(t, hs=hs)
    return put_book(t, request_id, replace(found, pending={**found.pending, page: tid})), True


def update_spills(
    t: Tiers, enqueued: Iterable[tuple[int, int]], completed: Iterable[tuple[int, int]]
) -> Tiers:
    """Apply the workers' counts (``update_spills``, ``_apply_enqueued_spills``,
    ``_complete_host_writes``, vLLM 0.33.0)."""
    transfers = dict(t.hs.transfers)
    for tid, count in enqueued:
        found = transfers.get(tid)
        if found is not None and found.expected == 0:
            transfers[tid] = replace(found, expected=count)
    for tid, count in completed:
        found = transfers.get(tid)
        if found is not None:
            transfers[tid] = replace(found, completed=found.completed + count)
    t = replace(t, hs=replace(t.hs, transfers=transfers))
    # every worker done: the spill's GPU references go back
    for tid, found in t.hs.transfers.items():
        if found.enqueue_applied or not found.expected or found.completed < found.expected:
            continue
        for block in found.resident_blocks:
            t, _ = device_pool(t, partial(pool_ops.free_blocks, ordered_block_ids=[block]))
        hs = t.hs
        t = replace(
            t, hs=replace(hs, transfers={**hs.transfers, tid: replace(found, enqueue_applied=True)})
        )
    done = [
        found
        for found in t.hs.transfers.values()
        if found.enqueue_applied and found.expected and found.completed >= found.expected
    ]
    completed_requests: list[str] = []
    for found in done:
        hs = t.hs
        t = replace(
            t,
            hs=replace(
                hs, transfers={k: v for k, v in hs.transfers.items() if k != found.transfer_id}
            ),
        )
        t = _complete_one(t, found, completed_requests)
        t, _ = host_pool(t, partial(pool_ops.free_blocks, ordered_block_ids=[found.host_block]))
    for request_id in completed_requests:
        current = t.hs.books[request_id]
        ready = current.ready_prefix_pages
        while ready in current.valid:
            ready += 1
        t = put_book(t, request_id, replace(current, ready_prefix_pages=ready))
        t = publish_if_ready(t, request_id)
    return t


def _complete_one(t: Tiers, found: Transfer, completed_requests: list[str]) -> Tiers:
    """One completed transfer lands on the book that planned it, if it is live or detached."""
    live = t.hs.books.get(found.request_id)
    if live is not None and live.generation == found.generation:
        pending = {p: i for p, i in live.pending.items() if p != found.page}
        valid = live.valid if found.restore else live.valid | {found.page}
        pinned = live.pinned_clean | {found.page} if found.page in valid else live.pinned_clean
        t = put_book(
            t, found.request_id, replace(live, pending=pending, valid=valid, pinned_clean=pinned)
        )
        # a page that became clean while its request reads from host is unpinned at once,
        # outside the active tail (_page_became_clean)
        if found.page in valid and can_read_from_host(t, found.request_id):
            t = unpin_page(t, found.request_id, found.page)
        if found.request_id not in completed_requests:
            completed_requests.append(found.request_id)
        return t
    waiting = t.hs.detached.get(found.generation)
    if waiting is None or waiting.publication is None:
        return t
    pending = {p: i for p, i in waiting.pending.items() if p != found.page}
    valid = waiting.valid if found.restore else waiting.valid | {found.page}
    return _publish_detached(t, replace(waiting, pending=pending, valid=valid))


def _publish_detached(t: Tiers, waiting: PageBook) -> Tiers:
    """Once a detached publication has no spill left, cache its clean prefix on the host
    pool and give back its blocks (``_publish_detached_blocks``)."""
    hs = t.hs
    publication = waiting.publication
    if publication is None or waiting.pending or publication.detached is None:
        detached = {**hs.detached, waiting.generation: waiting}
        return replace(t, hs=replace(hs, detached=detached))
    ready = waiting.ready_prefix_pages
    while ready in waiting.valid:
        ready += 1
    blocks = publication.detached
    num_full = min(ready, publication.num_pages)
    size, source = t.layout.block_size, t.layout.source
    if num_full > publication.num_cached_blocks:
        t, _ = host_pool(
            t,
            lambda p: pool_ops.cache_full_blocks(
                p,
                cache_request(publication.request),
                blocks,
                publication.num_cached_blocks,
                num_full,
                size,
                source,
            ),
        )
    t, _ = host_pool(t, lambda p: pool_ops.free_blocks(p, blocks[::-1]))
    hs = t.hs
    return replace(
        t,
        hs=replace(hs, detached={g: b for g, b in hs.detached.items() if g != waiting.generation}),
    )


# --------------------------------------------------------------------------
# Free
# --------------------------------------------------------------------------


def coordinator_free(
    t: Tiers, request_id: str, finished: bool
) -> tuple[Tiers, frozenset[tuple[int, int]]]:
    """The coordinator's part of a free (``HiSparseCoordinator.free``, vLLM 0.33.0).

    Forgets the request's book; detaches its publication if it finished with spills
    in flight (its host blocks held once more each), else drops it; in each resident
    group, tail first, unpins every clean page not being written back: the block joins
    the back of the device free queue, watched, still in ``copies``; a page unpinned
    earlier only loses its reader. Returns the (group, page) pairs taken out of the
    residency rows (those and the lost pages), which the resident groups then do not free.
    """
    hs = t.hs
    t = replace(t, hs=replace(hs, resident_marks=hs.resident_marks - {request_id}))
    found = t.hs.books.get(request_id)
    if found is None:
        return t, frozenset()
    hs = t.hs
    t = replace(t, hs=replace(hs, books={r: b for r, b in hs.books.items() if r != request_id}))
    publication = found.publication
    if publication is not None and finished and found.pending:
        table = t.managers.tables[t.layout.source]
        blocks = table.req_to_blocks[request_id][: publication.num_pages]
        publication = replace(
            publication,
            detached=blocks,
            num_cached_blocks=table.num_cached_block.get(request_id, 0),
        )
        t, _ = host_pool(t, lambda p: pool_ops.touch(p, blocks))
        hs = t.hs
        kept = replace(found, publication=publication)
        t = replace(t, hs=replace(hs, detached={**hs.detached, found.generation: kept}))
    dropped: set[tuple[int, int]] = set()
    for g in t.layout.residents:
        row = t.managers.tables[g].req_to_blocks.get(request_id, ())
        for page in reversed(range(len(row))):
            block = row[page]
            if page in found.lost:
                # host-only already: its block is not the request's to free
                dropped.add((g, page))
                continue
            if block == NULL_BLOCK_ID:
                continue
            if page in found.unpinned:
                # given back already: it stays a free, watched block nobody reads
                t = replace(t, hs=_set_owner(t.hs, block, (request_id, page), add=False))
            elif page in found.valid and page not in found.pending:
                t, _ = device_pool(t, partial(unpin_blocks, block_ids=[block], watcher=WATCHER))
            else:
                continue
            dropped.add((g, page))
    return t, frozenset(dropped)


def free(t: Tiers, request_id: str, finished: bool) -> Tiers:
    """Free the request group by group, each block to its own pool, last first.

    The source group runs the coordinator's part first (``HiSparseSourceManager``'s
    ``pop_blocks_for_free``, vLLM 0.33.0); a resident group frees its row without the
    pages the coordinator unpinned; a hot group forgets ``hot_required``.
    """
    m = t.managers
    hs = t.hs
    t = replace(t, hs=replace(hs, hot_required=hs.hot_required - {request_id}))
    dropped: frozenset[tuple[int, int]] = frozenset()
    for g in range(len(m.specs)):
        if g == t.layout.source:
            t, dropped = coordinator_free(t, request_id, finished)
            t, _ = on_host(t, partial(single.free, group=g, request_id=request_id))
            continue
        table = t.managers.tables[g]
        if request_id not in table.req_to_blocks:
            continue
        row = tuple(
            NULL_BLOCK_ID if (g, page) in dropped else b
            for page, b in enumerate(table.req_to_blocks[request_id])
        )
        t, _ = device_pool(t, partial(pool_ops.free_blocks, ordered_block_ids=row[::-1]))
        table = single.GroupTable(
            req_to_blocks={r: b for r, b in table.req_to_blocks.items() if r != request_id},
            num_cached_block={r: n for r, n in table.num_cached_block.items() if r != request_id},
        )
        tables = (*t.managers.tables[:g], table, *t.managers.tables[g + 1 :])
        t = replace(t, managers=replace(t.managers, tables=tables))
    return t


def resident_row(t: Tiers, group: int, request_id: str, start: int = 0) -> Sequence[int]:
    """The residency row from ``start``: the table row with lost pages as the null block
    (``get_residency_row``)."""
    row = t.managers.tables[group].req_to_blocks.get(request_id, ())
    lost = _lost(t, request_id)
    return tuple(
        NULL_BLOCK_ID if page in lost else b for page, b in enumerate(row) if page >= start
    )


def pop(t: Tiers, request_id: str, finished: bool) -> tuple[Tiers, tuple[tuple[bool, int], ...]]:
    """Take the request out of every group, its blocks still held: (on host, block id) in
    group order, each group's without its leading nulls; the coordinator's part runs at
    the source group, as in ``free`` (``KVCacheCoordinator.pop_blocks_for_free``)."""
    hs = t.hs
    t = replace(t, hs=replace(hs, hot_required=hs.hot_required - {request_id}))
    dropped: frozenset[tuple[int, int]] = frozenset()
    popped: list[tuple[bool, int]] = []
    for g in range(len(t.managers.specs)):
        if g == t.layout.source:
            t, dropped = coordinator_free(t, request_id, finished)
        table = t.managers.tables[g]
        row = tuple(
            NULL_BLOCK_ID if (g, page) in dropped else b
            for page, b in enumerate(table.req_to_blocks.get(request_id, ()))
        )
        head = 0
        while head < len(row) and row[head] == NULL_BLOCK_ID:
            head += 1
        popped.extend((g == t.layout.source, b) for b in row[head:])
        table = single.GroupTable(
            req_to_blocks={r: b for r, b in table.req_to_blocks.items() if r != request_id},
            num_cached_block={r: n for r, n in table.num_cached_block.items() if r != request_id},
        )
        tables = (*t.managers.tables[:g], table, *t.managers.tables[g + 1 :])
        t = replace(t, managers=replace(t.managers, tables=tables))
    return t, tuple(popped)
