"""HiSparse's coordinator, slices 1 and 2: write-back, publication, residency bookkeeping,
hot regions and the pages a request stops reading from the GPU.

vLLM 0.33.0's ``HiSparseCoordinator`` (``vllm/v1/hisparse/coordinator.py``) ties the source,
resident and hot groups together (docs/hisparse.md). kvpool builds it with the manager
(``kvpool.impl.KVCacheManager``) and answers with ``kvpool.model.hisparse_types`` records.
A request holding its hot region in every hot group reads from host: its clean sealed pages
outside the active tail are unpinned (``BlockPool.unpin_blocks``): still read, counted free.
When the device pool hands such a block out, the reuse watcher loses the page: it becomes
host-only in the residency row and stale for the worker (docs/hisparse.md, "Slice 2 in
kvpool.impl"). Host hits, imports and host copy-on-write are refused by the manager before
anything changes (later slices).

Every operation checks its arguments before it changes anything (the model's named errors).
A request is known when it holds blocks in the source group; operations on a request refuse
other ids (``UnknownRequest``) where vLLM creates an empty state for them (docs/hisparse.md,
"Surprises": a deliberate difference).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvpool.impl.block import KVCacheBlock
from kvpool.impl.hisparse_groups import (
    HiSparseHotManager,
    HiSparseResidentManager,
    HiSparseSourceManager,
)
from kvpool.impl.hisparse_layout import HiSparseLayout
from kvpool.impl.pool import BlockPool
from kvpool.model.errors import InvalidArgument, InvalidTokenCount, UnknownRequest
from kvpool.model.hisparse_types import (
    ACTIVE_TAIL_PAGES,
    PageTransfer,
    ResidencyUpdate,
    RowMirror,
)
from kvpool.model.state import HashKey


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Publication:
    """A source ``cache_blocks`` waiting for its pages' write-backs (vLLM's
    ``_PendingPublication``). ``detached_blocks`` is set when a finished request is freed
    with spills in flight: the host blocks of its pages, held once more until published."""

    __slots__ = (
        "detached_blocks",
        "num_cached_blocks",
        "num_computed_tokens",
        "num_pages",
        "request",
    )

    def __init__(self, request: Any, num_computed_tokens: int, num_pages: int) -> None:
        self.request = request
        self.num_computed_tokens = num_computed_tokens
        self.num_pages = num_pages
        self.detached_blocks: list[KVCacheBlock] | None = None
        self.num_cached_blocks = 0


class RequestState:
    """One request's page bookkeeping (vLLM's ``_HiSparseRequestState``): clean pages
    (``valid_pages``), the durable prefix, pages being written back (page to transfer id),
    clean pages still held, and what the worker has been sent."""

    __slots__ = (
        "copies_recorded_blocks",
        "pages_to_adopt",
        "pending_pages",
        "pinned_clean",
        "publication",
        "ready_prefix_pages",
        "stale_pages",
        "synced_pages",
        "unpinned_pages",
        "valid_pages",
    )

    def __init__(self) -> None:
        self.valid_pages: set[int] = set()
        self.ready_prefix_pages = 0
        self.pending_pages: dict[int, int] = {}
        self.publication: Publication | None = None
        self.copies_recorded_blocks = 0
        self.pinned_clean: set[int] = set()
        self.unpinned_pages: set[int] = set()
        """Clean pages whose block reference was released while the request reads them."""
        self.pages_to_adopt = 0
        """Always 0 in slice 1 (no host hit)."""
        self.synced_pages = 0
        self.stale_pages: set[int] = set()

    def __repr__(self) -> str:
        publication = self.publication
        return (
            f"RequestState(valid={sorted(self.valid_pages)}, ready={self.ready_prefix_pages}, "
            f"pending={self.pending_pages}, pinned_clean={sorted(self.pinned_clean)}, "
            f"unpinned={sorted(self.unpinned_pages)}, synced={self.synced_pages}, "
            f"stale={sorted(self.stale_pages)}, copies_recorded={self.copies_recorded_blocks}, "
            f"publication={None if publication is None else publication.num_pages})"
        )


class PendingSpill:
    """A planned transfer until every worker has completed it. It belongs to the request
    *state* that planned it (object identity, as vLLM's ``_PendingSpill``), so a request id
    reused after a free never receives an old transfer's completion."""

    __slots__ = (
        "completions",
        "enqueue_applied",
        "expected",
        "host_block",
        "page",
        "request_id",
        "resident_blocks",
        "state",
        "transfer_id",
    )

    def __init__(
        self,
        transfer_id: int,
        request_id: str,
        page: int,
        state: RequestState,
        host_block: KVCacheBlock,
        resident_blocks: tuple[KVCacheBlock, ...],
    ) -> None:
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.page = page
        self.state = state
        self.host_block = host_block
        self.resident_blocks = resident_blocks
        self.expected = 0
        self.completions = 0
        self.enqueue_applied = False


def is_finished(request: Any) -> bool:
    """Whether the request ended (vLLM's ``Request.is_finished()``); a request without that
    method (kvpool's own) is taken as not finished, so its waiting publication is dropped."""
    method = getattr(request, "is_finished", None)
    return bool(method()) if callable(method) else False


def _verify_request_id(request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"a request id is a str, not {type(request_id).__name__}")
    return request_id


def _verify_count(name: str, value: object) -> int:
    if type(value) is not int:
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidTokenCount(f"{name}={value} is negative")
    return value


def _verify_spans(requests: object) -> list[tuple[str, int, int]]:
    """``(request id, computed tokens, scheduled tokens)`` triples, checked, as a list."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise InvalidArgument("requests must be an iterable of (id, computed, scheduled)")
    spans: list[tuple[str, int, int]] = []
    for entry in requests:
        if not isinstance(entry, tuple) or len(entry) != 3:
            raise InvalidArgument(f"{entry!r:.60} is not an (id, computed, scheduled) triple")
        spans.append(
            (
                _verify_request_id(entry[0]),
                _verify_count("num_computed_tokens", entry[1]),
                _verify_count("num_scheduled_tokens", entry[2]),
            )
        )
    return spans


def _verify_counts(name: str, counts: object) -> dict[int, int]:
    if not isinstance(counts, Mapping):
        raise InvalidArgument(f"{name} must be a mapping of transfer id to count")
    out: dict[int, int] = {}
    for key, value in counts.items():
        if type(key) is not int:
            raise InvalidArgument(f"{name}: transfer id {key!r:.40} is not an int")
        if type(value) is not int or value < 1:
            raise InvalidArgument(f"{name}: the count of transfer {key} must be an int >= 1")
        out[key] = value
    return out


class HiSparseCoordinator:
    """The HiSparse state beside a manager's groups, with vLLM 0.33.0's operations (slice 1).

    Built by ``kvpool.impl.KVCacheManager`` from its ``HiSparseLayout``; reached from
    outside through ``kvpool.impl.get_hisparse_coordinator`` (vLLM's names).
    """

    def __init__(
        self,
        layout: HiSparseLayout,
        host_manager: HiSparseSourceManager,
        resident_managers: Sequence[HiSparseResidentManager],
        hot_managers: Sequence[HiSparseHotManager],
        gpu_pool: BlockPool,
        num_reprefillable_tokens: int,
    ) -> None:
        self.layout = layout
        self.host_manager = host_manager
        self.resident_managers = tuple(resident_managers)
        self.hot_managers = tuple(hot_managers)
        self.gpu_pool = gpu_pool
        self.host_pool = host_manager.block_pool
        self.page_size = layout.page_size
        self.num_reprefillable_tokens = num_reprefillable_tokens
        self.max_spill_pages = layout.max_spill_pages
        self.transition_watermark = layout.transition_watermark
        self.spills_to_send: list[PageTransfer] = []
        self.pending_spills: dict[int, PendingSpill] = {}
        self.request_states: dict[str, RequestState] = {}
        self.next_spill_id = 0
        self.copies: dict[HashKey, tuple[KVCacheBlock, ...]] = {}
        """Published host block's key to the GPU copies of that page, until reused."""
        self._copy_by_block: dict[int, HashKey] = {}
        self._resident_requests: set[str] = set()
        self._owners: dict[int, set[tuple[str, int]]] = {}
        """Unpinned device block id to the (request, page) pairs still reading it."""
        self.freeing: Any = None
        """The request the manager is freeing (``free``, ``pop_blocks_for_free``): whether it
        finished is read from it. vLLM reads the request its last ``cache_blocks`` stored,
        which is the same object in vLLM's scheduler; kvpool's requests are values, so the
        one given to ``free`` is the one that knows."""
        host_manager.coordinator = self
        for manager in self.resident_managers:
            manager.coordinator = self

    # ------------------------------------------------------------------
    # Requests and their states
    # ------------------------------------------------------------------

    def _verify_known(self, request_id: object) -> str:
        rid = _verify_request_id(request_id)
        # Verify that the request holds blocks (vLLM would create a state for any id)
        if rid not in self.host_manager.req_to_blocks:
            raise UnknownRequest(f"request {rid!r} holds no HiSparse blocks")
        return rid

    def _state(self, request_id: str) -> RequestState:
        state = self.request_states.get(request_id)
        if state is None:
            state = RequestState()
            self.request_states[request_id] = state
        return state

    def _can_read_from_host(self, request_id: str) -> bool:
        """Whether the request holds its hot region in every hot group."""
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def _fills_admission_window(self, request_id: str) -> bool:
        return any(
            len(m.req_to_blocks.get(request_id, ())) >= m.max_admission_blocks_per_request
            for m in self.resident_managers
        )

    def _resident_blocks(self, request_id: str, page: int) -> tuple[KVCacheBlock, ...] | None:
        """The page's GPU block in every resident group, or None if some group has none."""
        blocks: list[KVCacheBlock] = []
        for manager in self.resident_managers:
            block = manager.get_resident_page(request_id, page)
            if block is None:
                return None
            blocks.append(block)
        return tuple(blocks)

    # ------------------------------------------------------------------
    # Unpinning and losing pages
    # ------------------------------------------------------------------

    def _unpinnable_blocks(self, request_id: str, page: int) -> list[KVCacheBlock] | None:
        """The page's GPU block in every resident group, or None if some group has none or
        the page is in that group's active tail (the last ``ACTIVE_TAIL_PAGES`` pages)."""
        blocks: list[KVCacheBlock] = []
        for manager in self.resident_managers:
            num_pages = len(manager.req_to_blocks.get(request_id, ()))
            block = manager.get_resident_page(request_id, page)
            if block is None or page >= num_pages - ACTIVE_TAIL_PAGES:
                return None
            blocks.append(block)
        return blocks

    def _unpin_page(self, request_id: str, state: RequestState, page: int) -> None:
        if page in state.pending_pages or page not in state.valid_pages:
            return
        blocks = self._unpinnable_blocks(request_id, page)
        if blocks is None:
            return
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            self._owners.setdefault(block.block_id, set()).add((request_id, page))
            manager.block_pool.unpin_blocks([block], self._on_block_reused)
        state.pinned_clean.discard(page)
        state.unpinned_pages.add(page)

    def _unpin_clean_pages(self, request_id: str, state: RequestState) -> None:
        # tail first: the free queue hands out a prefix's tail pages before its head
        for page in sorted(state.pinned_clean, reverse=True):
            self._unpin_page(request_id, state, page)

    def _lose_page(self, request_id: str, page: int) -> None:
        """The device pool reused the block the request read ``page`` from: the page is
        host-only now, stale if the worker was sent it, and the request needs its region."""
        self._resident_requests.discard(request_id)
        state = self.request_states.get(request_id)
        if state is None:
            return
        for manager in self.resident_managers:
            block = manager.drop_resident_page(request_id, page)
            if block is None:
                continue
            owners = self._owners.get(block.block_id)
            if owners is not None:
                owners.discard((request_id, page))
        state.unpinned_pages.discard(page)
        if page < state.synced_pages:
            state.stale_pages.add(page)
        for hot in self.hot_managers:
            hot.hot_required.add(request_id)

    # ------------------------------------------------------------------
    # Copies of published pages
    # ------------------------------------------------------------------

    def _record_copies(self, request_id: str, num_tokens: int) -> None:
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if not host_blocks:
            return
        state = self._state(request_id)
        num_pages = min(num_tokens // self.page_size, len(host_blocks))
        for page in range(state.copies_recorded_blocks, num_pages):
            if page in state.pending_pages:
                continue
            self._record_copy(request_id, page, host_blocks[page])
        if num_pages > state.copies_recorded_blocks:
            state.copies_recorded_blocks = num_pages

    def _record_copy(self, request_id: str, page: int, host_block: KVCacheBlock) -> None:
        key = host_block._primary_key()
        if host_block.is_null or key is None:
            return
        blocks = self._resident_blocks(request_id, page)
        if blocks is None:
            return
        self._drop_copy(key)
        self.copies[key] = blocks
        for block in blocks:
            self._copy_by_block[block.block_id] = key

    def _drop_copy(self, key: HashKey) -> None:
        blocks = self.copies.pop(key, None)
        if blocks is None:
            return
        for block in blocks:
            self._copy_by_block.pop(block.block_id, None)

    def _on_block_reused(self, block: KVCacheBlock) -> None:
        """The device pool hands out (or a reset forgets) an unpinned block: its copy goes,
        and every request still reading it loses that page."""
        key = self._copy_by_block.get(block.block_id)
        if key is not None:
            self._drop_copy(key)
        owners = self._owners.pop(block.block_id, None)
        if owners:
            # a set: vLLM 0.33 iterates its own set here too; one owner in practice
            for request_id, page in sorted(owners):
                self._lose_page(request_id, page)

    # ------------------------------------------------------------------
    # The scheduler's per-step calls
    # ------------------------------------------------------------------

    def advance_scheduled(self, requests: object) -> None:
        """Per scheduled ``(request id, tokens computed once the step runs)``: write back the
        sealed pages (less the re-prefillable tail), then decide residency."""
        # Verify that the pairs are (known id, count), all of them before any change
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise InvalidArgument("requests must be an iterable of (id, tokens) pairs")
        pairs: list[tuple[str, int]] = []
        for entry in requests:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InvalidArgument(f"{entry!r:.60} is not an (id, tokens) pair")
            pairs.append((self._verify_known(entry[0]), _verify_count("num_tokens", entry[1])))
        for request_id, num_tokens in pairs:
            final = num_tokens - self.num_reprefillable_tokens
            self._plan_prefix_materialization(request_id, final if final > 0 else 0)
            self._update_residency(request_id)

    def plan_prefix_materialization(self, request_id: object, num_computed_tokens: object) -> None:
        """Plan a spill for every sealed page past the durable prefix that is neither clean
        nor being written and has a GPU copy in every resident group, in page order, within
        the spill budget."""
        rid = self._verify_known(request_id)
        self._plan_prefix_materialization(
            rid, _verify_count("num_computed_tokens", num_computed_tokens)
        )

    def _plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        num_pages = num_computed_tokens // self.page_size
        state = self._state(request_id)
        budget = self.max_spill_pages - len(self.spills_to_send)
        for page in range(state.ready_prefix_pages, num_pages):
            if budget <= 0:
                break
            if page in state.pending_pages or page in state.valid_pages:
                continue
            if self._plan_page_transfer(request_id, state, page):
                budget -= 1

    def _plan_page_transfer(self, request_id: str, state: RequestState, page: int) -> bool:
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if host_blocks is None or page >= len(host_blocks) or host_blocks[page].is_null:
            return False
        host_block = host_blocks[page]
        blocks = self._resident_blocks(request_id, page)
        if blocks is None:
            return False
        # the spill's own references: neither end may be reused while the copy runs
        self.host_pool.touch([host_block])
        for manager, block in zip(self.resident_managers, blocks, strict=True):
            manager.block_pool.touch([block])
        transfer_id = self.next_spill_id
        self.next_spill_id += 1
        self.pending_spills[transfer_id] = PendingSpill(
            transfer_id, request_id, page, state, host_block, blocks
        )
        state.pending_pages[page] = transfer_id
        self.spills_to_send.append(
            PageTransfer(
                transfer_id,
                host_block.block_id,
                tuple(b.block_id for b in blocks),
                after_forward=True,
            )
        )
        return True

    def update_residency(self, request_id: object) -> None:
        """A request reading from host unpins its clean sealed pages outside the active tail,
        tail first. One that cannot keeps its pages pinned until the device pool runs below
        the watermark or it fills its admission window; then it asks for a hot region (its
        next allocation takes it)."""
        self._update_residency(self._verify_known(request_id))

    def _update_residency(self, request_id: str) -> None:
        state = self._state(request_id)
        if self._can_read_from_host(request_id):
            self._unpin_clean_pages(request_id, state)
            return
        if (
            self.gpu_pool.get_num_free_blocks() >= self.transition_watermark
            and not self._fills_admission_window(request_id)
        ):
            return
        for manager in self.hot_managers:
            manager.hot_required.add(request_id)

    def require_hot(self, request_id: object) -> None:
        """Ask for the request's hot region in every hot group."""
        rid = self._verify_known(request_id)
        for manager in self.hot_managers:
            manager.hot_required.add(rid)

    def build_offload_command(self) -> tuple[PageTransfer, ...]:
        """The transfers planned since the last call, in order; the queue is emptied."""
        sent = tuple(self.spills_to_send)
        self.spills_to_send = []
        return sent

    # ------------------------------------------------------------------
    # The workers' acknowledgements
    # ------------------------------------------------------------------

    def update_spills(self, enqueued_counts: object, completed_counts: object) -> None:
        """Apply the workers' counts: the first non-zero enqueued count of a transfer is how
        many completions it waits for; completions add up; unknown ids are ignored. A
        transfer with all its completions gives back its references; a spill makes its page
        clean if its request is still the one that planned it, or feeds that request's
        detached publication; live requests then publish their durable prefix."""
        enqueued = _verify_counts("enqueued_counts", enqueued_counts)
        completed = _verify_counts("completed_counts", completed_counts)
        for transfer_id, count in enqueued.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None and pending.expected == 0:
                pending.expected = count
        for transfer_id, count in completed.items():
            pending = self.pending_spills.get(transfer_id)
            if pending is not None:
                pending.completions += count
        for pending in self.pending_spills.values():
            if pending.enqueue_applied or not pending.expected:
                continue
            if pending.completions < pending.expected:
                continue
            for manager, block in zip(self.resident_managers, pending.resident_blocks, strict=True):
                manager.block_pool.free_blocks([block])
            pending.enqueue_applied = True
        done = [p for p in self.pending_spills.values() if p.enqueue_applied]
        advanced: list[str] = []
        for pending in done:
            del self.pending_spills[pending.transfer_id]
            state = pending.state
            state.pending_pages.pop(pending.page, None)
            if self.request_states.get(pending.request_id) is state:
                state.valid_pages.add(pending.page)
                state.pinned_clean.add(pending.page)
                if self._can_read_from_host(pending.request_id):
                    self._unpin_page(pending.request_id, state, pending.page)
                if pending.request_id not in advanced:
                    advanced.append(pending.request_id)
            elif state.publication is not None:
                state.valid_pages.add(pending.page)
                self._publish_detached(state)
            self.host_pool.free_blocks([pending.host_block])
        for request_id in advanced:
            state = self.request_states[request_id]
            while state.ready_prefix_pages in state.valid_pages:
                state.ready_prefix_pages += 1
            self._publish_if_ready(request_id)

    # ------------------------------------------------------------------
    # Publication
    # ------------------------------------------------------------------

    def publish_when_ready(self, request: Any, num_computed_tokens: int) -> None:
        """Record the source's caching as a pending publication; publish its durable prefix."""
        request_id: str = request.request_id
        self._state(request_id).publication = Publication(
            request, num_computed_tokens, num_computed_tokens // self.page_size
        )
        self._publish_if_ready(request_id)

    def _publish_if_ready(self, request_id: str) -> None:
        state = self.request_states.get(request_id)
        if state is None or state.publication is None:
            return
        publication = state.publication
        durable = state.ready_prefix_pages * self.page_size
        num_tokens = min(publication.num_computed_tokens, durable)
        self.host_manager.publish_blocks(publication.request, num_tokens)
        self._record_copies(request_id, num_tokens)
        if state.ready_prefix_pages >= publication.num_pages:
            state.publication = None

    def _publish_detached(self, state: RequestState) -> None:
        publication = state.publication
        if publication is None or state.pending_pages:
            return
        blocks = publication.detached_blocks
        if blocks is None:
            return
        while state.ready_prefix_pages in state.valid_pages:
            state.ready_prefix_pages += 1
        num_full = min(state.ready_prefix_pages, publication.num_pages)
        if num_full > publication.num_cached_blocks:
            # only sealed pages whose copies completed outlive the request
            self.host_pool.cache_full_blocks(
                publication.request,
                blocks,
                publication.num_cached_blocks,
                num_full,
                self.page_size,
                self.host_manager.kv_cache_group_id,
            )
        self.host_pool.free_blocks(list(reversed(blocks)))
        state.publication = None

    # ------------------------------------------------------------------
    # Free
    # ------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        """Forget the request (the source and resident groups both call it; the second call
        finds nothing). A waiting publication is detached if the request finished with spills
        in flight, else dropped. Clean pages not being written back are unpinned, tail first:
        their blocks become free copies, taken out of the residency row."""
        self._resident_requests.discard(request_id)
        state = self.request_states.pop(request_id, None)
        if state is None:
            return
        publication = state.publication
        freeing = self.freeing
        if freeing is None or getattr(freeing, "request_id", None) != request_id:
            freeing = None if publication is None else publication.request
        if publication is not None and state.pending_pages and is_finished(freeing):
            detached = self.host_manager.req_to_blocks[request_id][: publication.num_pages]
            publication.detached_blocks = detached
            publication.num_cached_blocks = self.host_manager.num_cached_block.get(request_id, 0)
            self.host_pool.touch(detached)
        else:
            # a preemption may cancel a step whose spills were planned: nothing is proven
            state.publication = None
        for manager in self.resident_managers:
            row = manager.get_residency_row(request_id)
            for page in range(len(row) - 1, -1, -1):
                block = row[page]
                if block.is_null:
                    continue
                if page in state.unpinned_pages:
                    # already released: only the reading stops
                    owners = self._owners.get(block.block_id)
                    if owners is not None:
                        owners.discard((request_id, page))
                elif page in state.valid_pages and page not in state.pending_pages:
                    manager.block_pool.unpin_blocks([block], self._on_block_reused)
                else:
                    continue
                manager.drop_resident_page(request_id, page)

    # ------------------------------------------------------------------
    # What the workers read
    # ------------------------------------------------------------------

    def build_row_mirrors(self, requests: object) -> tuple[RowMirror, ...]:
        """Per ``(id, computed, scheduled)``, the rows the step writes on the GPU and where they
        go in the host blocks, page by page; pages without both ends are skipped. A query."""
        spans = _verify_spans(requests)
        size = self.page_size
        mirrors: list[RowMirror] = []
        for request_id, num_computed, num_scheduled in spans:
            host_blocks = self.host_manager.req_to_blocks.get(request_id)
            if host_blocks is None or any(
                request_id not in m.req_to_blocks for m in self.resident_managers
            ):
                continue
            position = num_computed
            end = num_computed + num_scheduled
            while position < end:
                page, offset = divmod(position, size)
                rows = min(size - offset, end - position)
                blocks = self._resident_blocks(request_id, page)
                if blocks is not None and page < len(host_blocks) and not host_blocks[page].is_null:
                    mirrors.append(
                        RowMirror(
                            tuple(b.block_id * size + offset for b in blocks),
                            host_blocks[page].block_id * size + offset,
                            rows,
                        )
                    )
                position += rows
        return tuple(mirrors)

    def all_context_pages_resident(self, requests: object) -> bool:
        """Whether every scheduled request has its pages in the first resident group's row and
        none host-only in any resident group. Remembers the requests found so."""
        spans = _verify_spans(requests)
        first = self.resident_managers[0]
        for request_id, num_computed, num_scheduled in spans:
            num_pages = _cdiv(num_computed + num_scheduled, first.block_size)
            if len(first.req_to_blocks.get(request_id, ())) < num_pages:
                return False
            if request_id in self._resident_requests:
                continue
            if any(
                block.is_null
                for manager in self.resident_managers
                for block in manager.get_residency_row(request_id)
            ):
                return False
            self._resident_requests.add(request_id)
        return True

    def take_residency_updates(self, request_ids: object) -> dict[str, ResidencyUpdate]:
        """Per scheduled request with something new: its stale pages, then the pages appended
        since the last update, with each resident group's block (the null block's id for a
        host-only page); then everything counts as sent."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise InvalidArgument("request_ids must be an iterable of request ids")
        ids = [self._verify_known(r) for r in request_ids]
        first = self.resident_managers[0]
        updates: dict[str, ResidencyUpdate] = {}
        for request_id in ids:
            state = self._state(request_id)
            num_pages = len(first.req_to_blocks.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            stale = sorted(state.stale_pages)
            rows: list[tuple[int, ...]] = []
            for manager in self.resident_managers:
                null_id = manager.block_pool.null_block.block_id
                ids_of_group = [
                    null_id if b is None else b.block_id
                    for b in (manager.get_resident_page(request_id, p) for p in stale)
                ]
                ids_of_group.extend(
                    b.block_id for b in manager.get_residency_row(request_id, start)
                )
                rows.append(tuple(ids_of_group))
            updates[request_id] = ResidencyUpdate((*stale, *range(start, num_pages)), tuple(rows))
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates

    def has_pending_reclamation(self) -> bool:
        """Whether a spill in flight will free a block when it completes (a host block only
        the spill holds, or a page of a request reading from host)."""
        return any(
            p.host_block.ref_cnt == 1
            or (p.request_id in self.request_states and self._can_read_from_host(p.request_id))
            for p in self.pending_spills.values()
        )

    def has_pending_work(self) -> bool:
        """Whether transfers are queued or in flight (host copies: none before slice 5)."""
        return bool(self.spills_to_send or self.pending_spills)
