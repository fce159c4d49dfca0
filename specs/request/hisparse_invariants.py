"""What must hold of a HiSparse manager's state in slice 1 (docs/hisparse.md, "The plan").

Checked on the model's state after every step of the HiSparse machine
(``kvpool.specs.request.hisparse_machine``), and usable on any ``KVCacheManagerState`` a
target shows. Each check raises ``AssertionError`` naming what broke:

* every block a table holds is held in its own pool (the source group's in the host
  pool), and no block of either pool is held by more tables than its reference count;
* every block of a transfer not yet done is held: its host block, and its GPU blocks
  until every worker has acknowledged it (``_PendingSpill`` keeps them);
* the durable prefix is clean: every page below ``ready_prefix_pages`` is valid, and no
  page is both valid and waiting for a transfer;
* only the durable prefix is published: a running request's source blocks past its
  ``ready_prefix_pages`` carry no hash (vLLM 0.33.0 publishes a page's hash once its
  write-back completed, ``_publish_ready_prefix`` in ``vllm/v1/hisparse/coordinator.py``).
"""

from collections import Counter

from kvpool.model.manager import KVCacheManagerState
from kvpool.model.state import NULL_BLOCK_ID, PoolState


def _held_at_least(pool: PoolState, wanted: Counter[int], what: str) -> None:
    for block_id, count in wanted.items():
        if block_id == NULL_BLOCK_ID:
            continue
        assert 0 <= block_id < len(pool.blocks), f"{what}: block {block_id} is not in its pool"
        ref_cnt = pool.blocks[block_id].ref_cnt
        assert ref_cnt >= count, (
            f"{what}: block {block_id} is held {count} times, its reference count is {ref_cnt}"
        )


def tables_held_in_their_pools(state: KVCacheManagerState) -> None:
    layout, host = state.config.hisparse, state.host_pool
    assert layout is not None and host is not None
    on_host: Counter[int] = Counter()
    on_device: Counter[int] = Counter()
    for g, table in enumerate(state.managers.tables):
        for blocks in table.req_to_blocks.values():
            (on_host if g == layout.source else on_device).update(blocks)
    _held_at_least(host, on_host, "host pool, source tables")
    _held_at_least(state.managers.pool, on_device, "device pool, tables")


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


HISPARSE_INVARIANTS = (
    tables_held_in_their_pools,
    transfers_hold_their_blocks,
    durable_prefix_is_clean,
    published_below_ready_prefix,
)


def check_hisparse(state: KVCacheManagerState) -> None:
    """Every invariant of this module on ``state`` (a HiSparse manager's)."""
    for check in HISPARSE_INVARIANTS:
        check(state)
