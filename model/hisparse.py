"""HiSparse's coordinator calls: write-back, residency and the workers' views (slices 1, 2).

vLLM 0.33.0's ``HiSparseCoordinator`` (``vllm/v1/hisparse/coordinator.py``) is built by
``get_hisparse_coordinator(manager)`` and shares the manager's state. Here its calls
are operations of the request layer, one pure function each over
``KVCacheManagerState``, ``(state, args) -> (state, result)``; a refused call changes
nothing. docs/hisparse.md describes each; "Modelled in slice 1" and "Modelled in slice 2"
say what is left out.

**Unknown request ids.** A request is known while it holds blocks in the source group.
``advance_scheduled``, ``plan_prefix_materialization``, ``update_residency``, ``require_hot``
and ``take_residency_updates`` refuse any other id (``UnknownRequest``, state unchanged),
the project's rule for bad input. vLLM 0.33.0 creates an empty book for it instead
(``_get_request_state``): a recorded difference (docs/hisparse.md, "Surprises";
docs/vllm-conformance.md, known differences). The queries ``build_row_mirrors`` and
``all_context_pages_resident`` skip unknown ids, as vLLM does.
"""

from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import partial

import kvpool.model.hisparse_core as core
import kvpool.model.pool as pool_ops
from kvpool.model.errors import (
    InvalidArgument,
    InvalidTokenCount,
    UnknownRequest,
)
from kvpool.model.events import MEDIUM_CPU, MEDIUM_GPU
from kvpool.model.hisparse_types import PageTransfer, ResidencyUpdate, RowMirror
from kvpool.model.manager import KVCacheManagerState, tiers, with_tiers
from kvpool.model.state import NULL_BLOCK_ID


def _verify_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"a request id is a str, got {type(request_id).__name__}")
    return request_id


def _verify_known(t: core.Tiers, request_id: str) -> None:
    # Verify that the request holds blocks in the source group (vLLM would create a book)
    if request_id not in t.managers.tables[t.layout.source].req_to_blocks:
        raise UnknownRequest(f"request {request_id!r} holds no HiSparse blocks")


def _verify_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    # Verify that the count is not negative
    if value < 0:
        raise InvalidTokenCount(f"{name}={value} is negative")
    return value


def _pairs(requests: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    try:
        listed = tuple(requests)
    except TypeError as error:
        raise InvalidArgument(f"expected (request id, tokens) pairs: {error}") from error
    out: list[tuple[str, int]] = []
    for pair in listed:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidArgument(f"expected a (request id, tokens) pair, got {pair!r}")
        out.append((_verify_id(pair[0]), _verify_count("num_tokens", pair[1])))
    return tuple(out)


def _spans(requests: Iterable[tuple[str, int, int]]) -> tuple[tuple[str, int, int], ...]:
    try:
        listed = tuple(requests)
    except TypeError as error:
        raise InvalidArgument(
            f"expected (request id, computed, scheduled) spans: {error}"
        ) from error
    out: list[tuple[str, int, int]] = []
    for span in listed:
        if not isinstance(span, tuple) or len(span) != 3:
            raise InvalidArgument(
                f"expected a (request id, computed, scheduled) span, got {span!r}"
            )
        out.append(
            (
                _verify_id(span[0]),
                _verify_count("num_computed_tokens", span[1]),
                _verify_count("num_scheduled_tokens", span[2]),
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------
# Write-back
# --------------------------------------------------------------------------


def advance_scheduled(
    state: KVCacheManagerState, requests: Iterable[tuple[str, int]]
) -> tuple[KVCacheManagerState, None]:
    """Per scheduled (request, tokens computed once the step runs): plan the write-back of
    its sealed pages, the last ``num_reprefillable_tokens`` left out, then decide its
    residency (``HiSparseCoordinator.advance_scheduled``, vLLM 0.33.0).
    """
    t = tiers(state)
    # Verify that every pair is a request id and a token count >= 0
    pairs = _pairs(requests)
    # Verify that every request is known
    for request_id, _ in pairs:
        _verify_known(t, request_id)
    for request_id, num_tokens in pairs:
        t = core.plan_materialization(
            t, request_id, max(0, num_tokens - t.layout.num_reprefillable_tokens)
        )
        t = _update_residency(t, request_id)
    return with_tiers(state, t), None


def plan_prefix_materialization(
    state: KVCacheManagerState, request_id: str, num_computed_tokens: int
) -> tuple[KVCacheManagerState, None]:
    """Plan a spill for each sealed page below ``num_computed_tokens`` that is dirty and has
    a GPU copy in every resident group, in page order, at most ``max_spill_pages`` queued
    (``HiSparseCoordinator.plan_prefix_materialization``, vLLM 0.33.0).
    """
    t = tiers(state)
    # Verify the arguments' types and that the count is not negative
    rid = _verify_id(request_id)
    n = _verify_count("num_computed_tokens", num_computed_tokens)
    # Verify that the request is known
    _verify_known(t, rid)
    return with_tiers(state, core.plan_materialization(t, rid, n)), None


def update_residency(
    state: KVCacheManagerState, request_id: str
) -> tuple[KVCacheManagerState, None]:
    """A scheduled request's residency step (``HiSparseCoordinator.update_residency``).

    A request that can read from host (it holds its hot region in every hot group)
    unpins every clean pinned page outside the active tail, tail first. One that cannot
    keeps its pages; once the device pool has fewer than ``transition_watermark`` free
    blocks, or the request holds its admission window of resident pages, it is marked
    ``hot_required``, and its next ``allocate_slots`` allocates the region.
    """
    t = tiers(state)
    # Verify that the id is a str and the request known
    rid = _verify_id(request_id)
    _verify_known(t, rid)
    return with_tiers(state, _update_residency(t, rid)), None


def _update_residency(t: core.Tiers, request_id: str) -> core.Tiers:
    t, _ = core.book(t, request_id)
    if core.can_read_from_host(t, request_id):
        return core.unpin_clean_pages(t, request_id)
    layout = t.layout
    fills_window = any(
        len(t.managers.tables[g].req_to_blocks.get(request_id, ())) >= layout.max_admission_pages
        for g in layout.residents
    )
    free = pool_ops.get_num_free_blocks(t.managers.pool)
    if free >= layout.transition_watermark and not fills_window:
        return t
    return core.require_hot(t, request_id)


def require_hot(state: KVCacheManagerState, request_id: str) -> tuple[KVCacheManagerState, None]:
    """Ask for the request's hot region in every hot group (``HiSparseHotManager.require_hot``);
    its next ``allocate_slots`` counts the region."""
    t = tiers(state)
    # Verify that the id is a str and the request known
    rid = _verify_id(request_id)
    _verify_known(t, rid)
    return with_tiers(state, core.require_hot(t, rid)), None


def build_offload_command(
    state: KVCacheManagerState,
) -> tuple[KVCacheManagerState, tuple[PageTransfer, ...]]:
    """The transfers planned since the last call, in order; the queue empties
    (``HiSparseCoordinator.build_offload_command``)."""
    t = tiers(state)
    transfers = tuple(
        PageTransfer(x.transfer_id, x.host_block, x.resident_blocks, x.after_forward, x.restore)
        for x in (t.hs.transfers[i] for i in t.hs.to_send)
    )
    t = replace(t, hs=replace(t.hs, to_send=()))
    return with_tiers(state, t), transfers


def _counts(name: str, counts: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    if not isinstance(counts, Mapping):
        raise InvalidArgument(f"{name} must map transfer ids to counts")
    out: list[tuple[int, int]] = []
    for tid, count in counts.items():
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise InvalidArgument(f"{name}: transfer id {tid!r} is not an int")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InvalidArgument(f"{name}: count {count!r} of transfer {tid} is not an int >= 1")
        out.append((tid, count))
    return tuple(out)


def update_spills(
    state: KVCacheManagerState, enqueued: Mapping[int, int], completed: Mapping[int, int]
) -> tuple[KVCacheManagerState, None]:
    """The workers' summed counts per transfer id (``HiSparseCoordinator.update_spills``).

    A transfer's first enqueued count is the number of completions it waits for (every
    worker enqueues a transfer in the same step: a precondition the model cannot check,
    docs/hisparse.md "Surprises"); completions add up; unknown ids are ignored. A
    transfer with all its completions gives its GPU blocks back; then it is done: its
    page becomes clean if its request is still the one that planned it (or joins that
    request's detached publication), and its host block is given back. Each request
    with a completed spill moves its durable prefix forward over clean pages and
    publishes it on the host pool.
    """
    t = tiers(state)
    # Verify that the counts map int ids to ints >= 1
    queued = _counts("enqueued", enqueued)
    done = _counts("completed", completed)
    return with_tiers(state, core.update_spills(t, queued, done)), None


# --------------------------------------------------------------------------
# The workers' views
# --------------------------------------------------------------------------


def build_row_mirrors(
    state: KVCacheManagerState, requests: Iterable[tuple[str, int, int]]
) -> tuple[RowMirror, ...]:
    """Per scheduled (request, computed, scheduled) span, per page it writes: the rows in
    each resident GPU block and in the host block; a page without either is skipped
    (``HiSparseCoordinator.build_row_mirrors``). A query: nothing changes."""
    t = tiers(state)
    # Verify that every span is a request id and two counts >= 0
    spans = _spans(requests)
    size = t.layout.block_size
    mirrors: list[RowMirror] = []
    for rid, computed, scheduled in spans:
        host_blocks = t.managers.tables[t.layout.source].req_to_blocks.get(rid)
        if host_blocks is None or any(
            rid not in t.managers.tables[g].req_to_blocks for g in t.layout.residents
        ):
            continue
        position, end = computed, computed + scheduled
        while position < end:
            page, offset = divmod(position, size)
            rows = min(size - offset, end - position)
            position += rows
            blocks = [core.resident_page(t, g, rid, page) for g in t.layout.residents]
            if any(b is None for b in blocks) or page >= len(host_blocks):
                continue
            if host_blocks[page] == NULL_BLOCK_ID:
                continue
            mirrors.append(
                RowMirror(
                    tuple(b * size + offset for b in blocks if b is not None),
                    host_blocks[page] * size + offset,
                    rows,
                )
            )
    return tuple(mirrors)


def all_context_pages_resident(
    state: KVCacheManagerState, requests: Iterable[tuple[str, int, int]]
) -> tuple[KVCacheManagerState, bool]:
    """Whether every scheduled span's pages are all on the GPU: the first resident group's
    row covers the span, and no resident row has a host-only page
    (``HiSparseCoordinator.all_context_pages_resident``). Requests found so are remembered
    (a cache of the answer, forgotten at free)."""
    t = tiers(state)
    # Verify that every span is a request id and two counts >= 0
    spans = _spans(requests)
    first = t.layout.residents[0]
    marks = t.hs.resident_marks
    answer = True
    for rid, computed, scheduled in spans:
        pages = -(-(computed + scheduled) // t.layout.block_size)
        if len(t.managers.tables[first].req_to_blocks.get(rid, ())) < pages:
            answer = False
            break
        if rid in marks:
            continue
        if any(
            b == NULL_BLOCK_ID for g in t.layout.residents for b in core.resident_row(t, g, rid)
        ):
            answer = False
            break
        marks = marks | {rid}
    t = replace(t, hs=replace(t.hs, resident_marks=marks))
    return with_tiers(state, t), answer


def take_residency_updates(
    state: KVCacheManagerState, request_ids: Iterable[str]
) -> tuple[KVCacheManagerState, dict[str, ResidencyUpdate]]:
    """Per listed request with something new: its stale pages, then the pages appended since
    the last update, each with its GPU block per resident group (the null block for a
    host-only page); everything becomes sent (``take_residency_updates``)."""
    t = tiers(state)
    try:
        ids = tuple(request_ids)
    except TypeError as error:
        raise InvalidArgument(f"expected request ids: {error}") from error
    # Verify that every id is a str
    for rid in ids:
        _verify_id(rid)
    # Verify that every request is known
    for rid in ids:
        _verify_known(t, rid)
    updates: dict[str, ResidencyUpdate] = {}
    first = t.layout.residents[0]
    for rid in ids:
        t, found = core.book(t, rid)
        num_pages = len(t.managers.tables[first].req_to_blocks.get(rid, ()))
        start = found.synced_pages
        if not found.stale and start >= num_pages:
            continue
        stale = sorted(found.stale)
        rows: list[tuple[int, ...]] = []
        for g in t.layout.residents:
            changed = [core.resident_page(t, g, rid, p) for p in stale]
            rows.append(
                (
                    *(NULL_BLOCK_ID if b is None else b for b in changed),
                    *core.resident_row(t, g, rid, start),
                )
            )
        updates[rid] = ResidencyUpdate((*stale, *range(start, num_pages)), tuple(rows))
        t = core.put_book(t, rid, replace(found, stale=frozenset(), synced_pages=num_pages))
    return with_tiers(state, t), updates


def has_pending_reclamation(state: KVCacheManagerState) -> bool:
    """Whether a spill in flight will free a block when it completes: its host block is held
    by the spill alone, or its request reads from host (``has_pending_reclamation``)."""
    t = tiers(state)
    return any(
        t.host.blocks[x.host_block].ref_cnt == 1
        or (x.request_id in t.hs.books and core.can_read_from_host(t, x.request_id))
        for x in t.hs.transfers.values()
    )


def has_pending_work(state: KVCacheManagerState) -> bool:
    """Whether transfers are queued or in flight (``HiSparseCoordinator.has_pending_work``;
    host copies, the third kind, come with slice 5)."""
    t = tiers(state)
    return bool(t.hs.to_send or t.hs.transfers)


def copies(state: KVCacheManagerState) -> Mapping[tuple[bytes, int], tuple[int, ...]]:
    """The GPU copies of published host pages, by host hash key (the coordinator's ``copies``)."""
    return tiers(state).hs.copies


def hot_required(state: KVCacheManagerState) -> frozenset[str]:
    """The requests asked for a hot region (each hot manager's ``hot_required``)."""
    return tiers(state).hs.hot_required


# --------------------------------------------------------------------------
# The deferred free: blocks of two pools
# --------------------------------------------------------------------------

PoolBlock = tuple[str, int]
"""A block named with its pool: (``MEDIUM_CPU`` for the host pool or ``MEDIUM_GPU``, id).
Block ids are numbered per pool, so a block handed out of a HiSparse manager names both."""


def pop_blocks_for_free(
    state: KVCacheManagerState, request_id: str, *, finished: bool = False
) -> tuple[KVCacheManagerState, tuple[PoolBlock, ...]]:
    """A HiSparse manager's ``pop_blocks_for_free``: the request leaves every group (the
    coordinator's part runs: publication detached or dropped, clean pages unpinned) and
    its remaining blocks come back still held, group by group, each group's in allocation
    order without leading nulls, named with their pool (vLLM 0.33.0 returns block objects
    that know their pool: ``BlockPool.free_blocks`` hands each to its own)."""
    t = tiers(state)
    # Verify that the id is a str
    rid = _verify_id(request_id)
    t, popped = core.pop(t, rid, bool(finished))
    return with_tiers(state, t), tuple(
        (MEDIUM_CPU if on_host else MEDIUM_GPU, b) for on_host, b in popped
    )


def free_pool_blocks(
    state: KVCacheManagerState, blocks: Iterable[PoolBlock]
) -> tuple[KVCacheManagerState, None]:
    """Release one reference per listed block, each in its own pool, in the listed order
    (``BlockPool.free_blocks`` through ``block.pool``, vLLM 0.33.0)."""
    t = tiers(state)
    try:
        listed = tuple(blocks)
    except TypeError as error:
        raise InvalidArgument(f"expected (pool, block id) pairs: {error}") from error
    # Verify that every entry names a pool and an int block id
    for entry in listed:
        if (
            not isinstance(entry, tuple)
            or len(entry) != 2
            or entry[0] not in (MEDIUM_CPU, MEDIUM_GPU)
            or not isinstance(entry[1], int)
            or isinstance(entry[1], bool)
        ):
            raise InvalidArgument(f"expected a (pool, block id) pair, got {entry!r}")
    host_ids = [b for medium, b in listed if medium == MEDIUM_CPU]
    device_ids = [b for medium, b in listed if medium == MEDIUM_GPU]
    # the pool checks its ids (UnknownBlock, OverFree) before anything changes
    t, _ = core.host_pool(t, partial(pool_ops.free_blocks, ordered_block_ids=host_ids))
    t, _ = core.device_pool(t, partial(pool_ops.free_blocks, ordered_block_ids=device_ids))
    return with_tiers(state, t), None
