"""What must hold of a HiSparse manager's state in slices 1 and 2 (docs/hisparse.md, "The plan").

Checked on the model's state after every step of the HiSparse machine
(``kvpool.specs.request.hisparse_machine``), and usable on any ``KVCacheManagerState`` a
target shows. Each check raises ``AssertionError`` naming what broke:

* each pool on its own keeps the pool's invariants (``kvpool.specs.pool.invariants``:
  free queue and reference counts agree, the hash map names hashed blocks, ...);
* reference counts add up, per pool: each block's count is the number of its holders
  (tables, transfers, a finished request's detached publication, blocks pressed out);
* every block of a transfer not yet done is held: its host block, and its GPU blocks
  until every worker has acknowledged it (``_PendingSpill`` keeps them);
* the durable prefix is clean: every page below ``ready_prefix_pages`` is valid, and no
  page is both valid and waiting for a transfer;
* only the durable prefix is published: a running request's source blocks past its
  ``ready_prefix_pages`` carry no hash (vLLM 0.33.0 publishes a page's hash once its
  write-back completed, ``_publish_ready_prefix`` in ``vllm/v1/hisparse/coordinator.py``);
* slice 2: an unpinned page is clean and given back, its GPU blocks free and watched,
  and the coordinator's readers are exactly the unpinned pages; stale pages were sent.
  The reference counts leave out unpinned and lost pages, which stay in the
  append-only resident tables.
"""

from collections import Counter
from collections.abc import Mapping, Sequence

from kvpool.model.manager import KVCacheManagerState
from kvpool.model.state import NULL_BLOCK_ID, PoolState
from kvpool.specs.pool.invariants import check_all


def _held_at_least(pool: PoolState, wanted: Counter[int], what: str) -> None:
    for block_id, count in wanted.items():
        if block_id == NULL_BLOCK_ID:
            continue
        assert 0 <= block_id < len(pool.blocks), f"{what}: block {block_id} is not in its pool"
        ref_cnt = pool.blocks[block_id].ref_cnt
        assert ref_cnt >= count, (
            f"{what}: block {block_id} is held {count} times, its reference count is {ref_cnt}"
        )


def pools_keep_their_invariants(state: KVCacheManagerState) -> None:
    assert state.host_pool is not None
    check_all(state.managers.pool)
    check_all(state.host_pool)


def ref_counts_add_up(
    state: KVCacheManagerState, pressed: Mapping[str, Sequence[int]] | None = None
) -> None:
    """Every block's reference count is exactly its holders': on the device pool the tables
    of the device groups and the GPU blocks of transfers not yet acknowledged by every
    worker; on the host pool the source group's tables, the host blocks of pending
    transfers and the blocks a freed, finished request's publication keeps. ``pressed``:
    blocks taken from each pool directly ("CPU", "GPU") and not yet given back."""
    layout, host, books = state.config.hisparse, state.host_pool, state.hisparse
    assert layout is not None and host is not None and books is not None
    on_host: Counter[int] = Counter((pressed or {}).get("CPU", ()))
    on_device: Counter[int] = Counter((pressed or {}).get("GPU", ()))
    for g, table in enumerate(state.managers.tables):
        for rid, blocks in table.req_to_blocks.items():
            if g in layout.residents and rid in books.books:
                # unpinned and lost pages stay in the append-only table, given back
                book = books.books[rid]
                given_back = book.unpinned | book.lost
                blocks = tuple(b for page, b in enumerate(blocks) if page not in given_back)
            (on_host if g == layout.source else on_device).update(blocks)
    for transfer in books.transfers.values():
        on_host[transfer.host_block] += 1
        if not transfer.enqueue_applied:
            on_device.update(transfer.resident_blocks)
    for book in (*books.books.values(), *books.detached.values()):
        if book.publication is not None and book.publication.detached:
            on_host.update(book.publication.detached)
    for name, pool, held in (("device", state.managers.pool, on_device), ("host", host, on_host)):
        for block_id, block in enumerate(pool.blocks):
            if block_id != NULL_BLOCK_ID and block.ref_cnt != held[block_id]:
                raise AssertionError(
                    f"{name} pool: block {block_id} has reference count {block.ref_cnt}, "
                    f"its holders add up to {held[block_id]}"
                )


def transfers_hold_their_blocks(state: KVCacheManagerState) -> None:
    books, host = state.hisparse, state.host_pool
    assert books is not None and host is not None
    host_held: Counter[int] = Counter()
    device_held: Counter[int] = Counter()
    for transfer in books.transfers.values():
        host_held[transfer.host_block] += 1
        if not transfer.enqueue_applied:
            device_held.update(b for b in transfer.resident_blocks)
    _held_at_least(host, Counter({b: 1 for b in host_held}), "host pool, pending transfers")
    _held_at_least(
        state.managers.pool, Counter({b: 1 for b in device_held}), "device pool, pending transfers"
    )


def durable_prefix_is_clean(state: KVCacheManagerState) -> None:
    books = state.hisparse
    assert books is not None
    for rid, book in books.books.items():
        missing = set(range(book.ready_prefix_pages)) - book.valid
        assert not missing, f"{rid}: pages {sorted(missing)} below the ready prefix are not valid"
        both = book.valid & set(book.pending)
        assert not both, f"{rid}: pages {sorted(both)} are valid and still being written back"


def published_below_ready_prefix(state: KVCacheManagerState) -> None:
    layout, books, host = state.config.hisparse, state.hisparse, state.host_pool
    assert layout is not None and books is not None and host is not None
    table = state.managers.tables[layout.source].req_to_blocks
    for rid, book in books.books.items():
        for page, block_id in enumerate(table.get(rid, ())):
            if page >= book.ready_prefix_pages and block_id != NULL_BLOCK_ID:
                assert host.blocks[block_id].block_hash is None, (
                    f"{rid}: page {page} (host block {block_id}) is published, its ready "
                    f"prefix is {book.ready_prefix_pages} pages"
                )


def unpinned_pages_are_watched(state: KVCacheManagerState) -> None:
    """Slice 2: an unpinned page is clean, neither pinned, being written back nor lost, and
    each of its GPU blocks is free, watched by the coordinator and read by the page; the
    coordinator's readers name only such pages (``_unpin_page``, ``_owners``, vLLM 0.33.0)."""
    layout, books = state.config.hisparse, state.hisparse
    assert layout is not None and books is not None
    pool = state.managers.pool
    readers: set[tuple[int, str, int]] = set()
    for rid, book in books.books.items():
        wrong = book.unpinned - book.valid | (book.unpinned & (book.pinned_clean | book.lost))
        wrong |= book.unpinned & set(book.pending)
        assert not wrong, f"{rid}: unpinned pages {sorted(wrong)} are not clean and given back"
        for page in book.unpinned:
            for g in layout.residents:
                block = state.managers.tables[g].req_to_blocks[rid][page]
                assert pool.blocks[block].ref_cnt == 0 and block in pool.watchers, (
                    f"{rid}: unpinned page {page}'s block {block} is held or not watched"
                )
                readers.add((block, rid, page))
    recorded = {(b, r, p) for b, owners in books.owners.items() for r, p in owners}
    assert recorded == readers, (
        f"the coordinator's readers {sorted(recorded)} are not the unpinned pages' "
        f"{sorted(readers)}"
    )


def stale_pages_were_sent(state: KVCacheManagerState) -> None:
    """A stale page (changed since the worker got it) is below ``synced_pages``."""
    books = state.hisparse
    assert books is not None
    for rid, book in books.books.items():
        late = {p for p in book.stale if p >= book.synced_pages}
        assert not late, f"{rid}: stale pages {sorted(late)} were never sent"


HISPARSE_INVARIANTS = (
    pools_keep_their_invariants,
    transfers_hold_their_blocks,
    durable_prefix_is_clean,
    published_below_ready_prefix,
    unpinned_pages_are_watched,
    stale_pages_were_sent,
)


def check_hisparse(
    state: KVCacheManagerState, pressed: Mapping[str, Sequence[int]] | None = None
) -> None:
    """Every invariant of this module on ``state`` (a HiSparse manager's); ``pressed`` as
    ``ref_counts_add_up`` takes it."""
    for check in HISPARSE_INVARIANTS:
        check(state)
    ref_counts_add_up(state, pressed)
