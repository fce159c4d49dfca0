"""kvpool's HiSparse model (slices 1 and 2) against vLLM 0.33.0's manager and coordinator.

Scenarios scripted after the slice-1 and slice-2 tests of vLLM 0.33.0's
``tests/v1/core/test_prefix_caching.py`` (docs/hisparse.md, "The 55 tests"); every call
runs on both sides, and ``Pair.compare`` checks the states after each. vLLM is
optional: these tests skip, visibly, without it, and fail when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import pytest

import kvpool.model.hisparse as hs
import kvpool.model.manager as mgr
from kvpool.model.errors import UnknownRequest
from tests.request.hisparse_pair import BLOCK, Pair, run_random_program

pytestmark = pytest.mark.usefixtures("require_vllm_manager")


def test_worked_example_write_back_and_publication() -> None:
    """docs/hisparse.md's first worked example, and its free queue after the free."""
    pair = Pair(32, 16, enable_caching=True)
    pair.request("a", list(range(64)))
    assert pair.allocate_scheduled("a", 64)
    pair.request("b", list(range(64)))
    assert pair.hit("b") == 0
    transfers = pair.offload()
    assert [t.host_block_id for t in transfers] == [1, 2, 3, 4]
    pair.spills({1: 1}, {1: 1})
    assert pair.hit("b") == 0
    pair.spills({0: 1, 2: 1, 3: 1}, {0: 1, 2: 1, 3: 1})
    assert pair.hit("b") == 48
    pair.free("a", finished=True)
    assert pair.model.managers.pool.free_queue[-8:] == (8, 7, 6, 5, 4, 3, 2, 1)


def test_reprefillable_tokens_are_not_written_back() -> None:
    pair = Pair(32, 16, num_prefill_lookahead=3)
    pair.request("r", list(range(2 * BLOCK)))
    assert pair.allocate_scheduled("r", 2 * BLOCK)
    assert len(pair.offload()) == 1


def test_full_pool_keeps_pages_pinned_until_preemption() -> None:
    pair = Pair(18, 18, max_model_len=160)
    pair.request("first", list(range(128)))
    assert pair.allocate_scheduled("first", 128)
    pair.publish()
    pair.computed("first", 128)
    pair.append("first", [7])
    assert not pair.allocate_scheduled("first", 1)
    assert pair.all_resident([("first", 127, 1)])
    pair.free("first")
    pair.request("second", [1000] * 16)
    assert pair.allocate_scheduled("second", 16)


@pytest.mark.parametrize("num_pages", [3, 4])
def test_prefill_reads_host_once_it_fills_admission_window(num_pages: int) -> None:
    pair = Pair(32, 16, enable_caching=True, max_in_flight_tokens=4 * BLOCK)
    pair.request("prefill", list(range(8 * BLOCK)))
    assert pair.allocate_scheduled("prefill", num_pages * BLOCK)
    assert ("prefill" in pair.coordinator.hot_managers[0].hot_required) == (num_pages == 4)


def test_terminal_prefix_waits_for_all_workers_and_preserves_identity() -> None:
    pair = Pair(32, 8, enable_caching=True)
    tokens = list(range(2 * BLOCK + 1))
    pair.request("reused", tokens)
    assert pair.allocate_scheduled("reused", len(tokens))
    counts = {t.transfer_id: 2 for t in pair.offload()}
    partial = dict.fromkeys(counts, 1)
    first = {**partial, next(iter(counts)): 2}
    pair.spills(counts, first)
    pair.free("reused", finished=True)
    pair.request("reused", list(range(100, 117)))
    assert pair.allocate_scheduled("reused", 17)
    pressure = pair.press_host(len(pair.model.host_pool.free_queue))  # type: ignore[union-attr]
    pair.spills({}, partial)
    pair.request("probe", tokens)
    assert pair.hit("probe") == 2 * BLOCK
    pair.spills({}, partial)
    pair.release_host(pressure)
    pair.free("reused")
    pair.publish()
    assert not pair.coordinator.has_pending_work()


@pytest.mark.parametrize("finished", [True, False])
def test_cleanup_publishes_only_finalized_terminal_pages(finished: bool) -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("terminal", list(range(33)))
    assert pair.allocate_scheduled("terminal", 49, num_lookahead_tokens=16)
    counts = {t.transfer_id: 1 for t in pair.offload()}
    assert len(counts) == 2
    pair.free("terminal", finished=finished)
    pair.spills(counts, counts)
    host = pair.model.host_pool
    assert host is not None
    assert sum(b.block_hash is not None for b in host.blocks) == (2 if finished else 0)


def test_events_report_host_and_device_placement() -> None:
    pair = Pair(32, 16, enable_caching=True, enable_events=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 64)
    pair.publish()
    media = {e[1] for e in pair.events() if e[0] == "BlockStored"}
    assert media == {"CPU", "GPU"}
    pair.free("r", finished=True)
    pair.press_host(15)
    assert [e[:2] for e in pair.events()] == [("BlockRemoved", "CPU")] * 4


def test_reset_prefix_cache_drops_copies() -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 64)
    pair.publish()
    assert len(pair.coordinator.copies) == 4
    assert not pair.reset()
    pair.free("r", finished=True)
    assert pair.reset()
    assert not pair.coordinator.copies


def test_finished_request_leaves_free_copies_dropped_on_reuse() -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 64)
    pair.publish()
    pair.free("r", finished=True)
    assert len(pair.coordinator.copies) == 4
    pair.press_device(25)
    assert len(pair.coordinator.copies) == 2


def test_device_eviction_keeps_host_prefix() -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 64)
    pair.publish()
    pair.free("r", finished=True)
    pair.evict({1})
    pair.request("again", list(range(64)))
    assert pair.hit("again") == 0


def test_preempted_prefill_resumes_from_durable_prefix() -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 32)
    transfers = pair.offload()
    pair.spills({transfers[0].transfer_id: 1}, {transfers[0].transfer_id: 1})
    pair.free("r")
    pair.request("r", list(range(64)))
    assert pair.hit("r") == BLOCK
    pair.spills({transfers[1].transfer_id: 1}, {transfers[1].transfer_id: 1})


def test_materialization_with_partial_acknowledgements() -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(48)))
    assert pair.allocate_scheduled("r", 48)
    transfers = pair.offload()
    ids = [t.transfer_id for t in transfers]
    pair.spills({ids[0]: 2, ids[1]: 1}, {ids[0]: 1, 99: 1})
    pair.spills({ids[0]: 1}, {ids[0]: 1, ids[1]: 1})
    pair.computed("r", 48)
    pair.append("r", list(range(48, 64)))
    assert pair.allocate_scheduled("r", 16)
    pair.publish()


def test_residency_updates_and_row_mirrors() -> None:
    pair = Pair(32, 16, num_resident_groups=3)
    pair.request("r", list(range(40)))
    assert pair.allocate_scheduled("r", 40)
    pair.mirrors([("r", 10, 30), ("ghost", 0, 4)])
    pair.residency(["r"])
    pair.residency(["r"])
    assert pair.all_resident([("r", 0, 40)])
    pair.free("r")
    pair.request("r", list(range(40)))
    assert pair.allocate_scheduled("r", 40)
    pair.residency(["r"])
    pair.request("ghost", [1])
    pair.free("ghost")


def test_vllm_creates_a_book_for_an_unknown_id() -> None:
    """A recorded difference (docs/hisparse.md): vLLM 0.33.0 creates an empty state for an
    id it does not know (``_get_request_state``); the spec refuses it, state unchanged. If
    this fails, vLLM changed: the difference may be gone."""
    pair = Pair(32, 16)
    pair.request("r", list(range(40)))
    assert pair.allocate_scheduled("r", 40)
    before = pair.model
    with pytest.raises(UnknownRequest):
        hs.take_residency_updates(pair.model, ["ghost"])
    with pytest.raises(UnknownRequest):
        hs.advance_scheduled(pair.model, [("ghost2", 0)])
    assert pair.model == before
    pair.coordinator.take_residency_updates(["ghost"])
    pair.coordinator.advance_scheduled([("ghost2", 0)])
    assert {"ghost", "ghost2"} <= set(pair.coordinator.request_states)


def test_vllm_resets_the_idle_pool_when_the_other_refuses() -> None:
    """A vLLM finding (docs/hisparse.md): a refused reset still forgets the idle host pool's
    hashes (``KVCacheCoordinator.reset_prefix_cache``, 0.33.0); the spec changes nothing.
    If this fails, vLLM changed: the finding may be fixed."""
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(64)))
    assert pair.allocate_scheduled("r", 64)
    pair.publish()
    pair.free("r", finished=True)
    pair.press_device(1)
    before = pair.model
    pair.model, done = mgr.reset_prefix_cache(pair.model)
    assert not done and pair.model == before
    assert pair.model.host_pool is not None
    assert sum(b.block_hash is not None for b in pair.model.host_pool.blocks) == 4
    host = pair.coordinator.get_host_block_pool()
    assert sum(b.block_hash is not None for b in host.blocks) == 4
    assert not pair.vllm.reset_prefix_cache()
    assert sum(b.block_hash is not None for b in host.blocks) == 0


def test_full_sequence_must_fit_caps_resident_pages() -> None:
    pair = Pair(12, 16, max_in_flight_tokens=2 * BLOCK)
    pair.request("long", list(range(5 * BLOCK)))
    assert pair.allocate_scheduled("long", 2 * BLOCK, full_sequence_must_fit=True)
    pair.request("other", list(range(6 * BLOCK)))
    assert not pair.allocate("other", BLOCK, full_sequence_must_fit=True)


def test_host_exhaustion_refuses_and_frees_nothing() -> None:
    pair = Pair(32, 4)
    pair.request("r", list(range(64)))
    assert not pair.allocate("r", 64)
    assert pair.allocate_scheduled("r", 48)


def test_running_request_grows_without_hot_capacity() -> None:
    pair = Pair(32, 16)
    pair.request("r", list(range(32)))
    assert pair.allocate_scheduled("r", 32)
    pair.computed("r", 32)
    pair.append("r", [1])
    assert pair.allocate_scheduled("r", 1)


def test_deferred_free_retains_host_blocks_until_fence() -> None:
    pair = Pair(16, 16)
    pair.request("free", list(range(16)))
    assert pair.allocate("free", 16, delay_cache_blocks=True)
    pair.free_popped(pair.pop("free"))
    assert len(pair.model.managers.pool.free_queue) == 15


@pytest.mark.parametrize("finished", [True, False])
def test_deferred_free_with_spills_in_flight(finished: bool) -> None:
    pair = Pair(32, 16, enable_caching=True)
    pair.request("r", list(range(50)))
    assert pair.allocate_scheduled("r", 50)
    counts = {t.transfer_id: 1 for t in pair.offload()}
    pair.spills(counts, {0: 1})
    blocks = pair.pop("r", finished=finished)
    pair.spills({}, counts)
    pair.free_popped(blocks)
    pair.request("probe", list(range(50)))
    assert pair.hit("probe") == (48 if finished else 16)


@pytest.mark.parametrize("seed", range(12))
def test_random_programs(seed: int) -> None:
    """Seeded random programs over every slice-1 and slice-2 call (``run_random_program``):
    they allocate hot regions, unpin pages and lose them."""
    run_random_program(seed, 60)


# --------------------------------------------------------------------------
# Slice 2: hot regions, unpinning, losing pages (docs/hisparse.md, "Modelled in slice 2")
# --------------------------------------------------------------------------


def _clean_then_hot(pair: Pair, rid: str, tokens: int, num_free_left: int) -> None:
    """``rid`` written back and clean, pinned; the device pool pressed below the watermark
    while it is scheduled, so it asks for a hot region; the pressure released."""
    pair.request(rid, list(range(tokens)))
    assert pair.allocate_scheduled(rid, tokens)
    pair.publish()
    free = len(pair.model.managers.pool.free_queue)
    held = pair.press_device(free - num_free_left)
    pair.advance([(rid, tokens)])
    assert rid in pair.model.hisparse.hot_required  # type: ignore[union-attr]
    pair.release_device(held)


@pytest.mark.parametrize("num_resident_groups", [1, 3])
def test_keeps_resident_pages_until_hot_region_is_allocated(num_resident_groups: int) -> None:
    """After ``test_hisparse_keeps_resident_pages_until_hot_buffer_is_allocated`` (2 ids):
    asked for a hot region, the request keeps its clean pages pinned and all resident until
    its next allocation gives it the region; then the clean pages outside the active tail
    are unpinned, tail first, and still read."""
    pair = Pair(40, 16, enable_caching=True, num_resident_groups=num_resident_groups)
    _clean_then_hot(pair, "r", 64, num_free_left=1)
    assert pair.model.hisparse.books["r"].pinned_clean == {0, 1, 2, 3}  # type: ignore[union-attr]
    assert pair.all_resident([("r", 63, 1)])
    pair.computed("r", 64)
    pair.append("r", [1])
    assert pair.allocate_scheduled("r", 1)
    book = pair.model.hisparse.books["r"]  # type: ignore[union-attr]
    assert (book.unpinned, book.pinned_clean) == (frozenset({0, 1, 2}), frozenset({3}))
    # unpinned blocks are free, at the back of the queue, still in the residency rows
    tables = pair.model.managers.tables
    residents = pair.model.config.hisparse.residents  # type: ignore[union-attr]
    unpinned = tuple(tables[g].req_to_blocks["r"][page] for page in (2, 1, 0) for g in residents)
    assert pair.model.managers.pool.free_queue[-len(unpinned) :] == unpinned
    assert pair.all_resident([("r", 64, 1)])
    pair.residency(["r"])


def test_reports_when_context_is_fully_resident() -> None:
    """After ``test_hisparse_reports_when_context_is_fully_resident``: once the pool hands
    out the unpinned blocks, their pages are host-only: not all resident, the block table
    unchanged, the residency update lists the lost pages with the null block's id."""
    pair = Pair(24, 16, enable_caching=True)
    _clean_then_hot(pair, "r", 64, num_free_left=1)
    pair.computed("r", 64)
    pair.append("r", [1])
    assert pair.allocate_scheduled("r", 1)
    pair.residency(["r"])
    assert pair.all_resident([("r", 64, 1)])
    table = pair.model.managers.tables[2].req_to_blocks["r"]
    pair.press_device(len(pair.model.managers.pool.free_queue))
    book = pair.model.hisparse.books["r"]  # type: ignore[union-attr]
    assert (book.lost, book.unpinned, book.stale) == (
        frozenset({0, 1, 2}),
        frozenset(),
        frozenset({0, 1, 2}),
    )
    assert pair.model.managers.tables[2].req_to_blocks["r"] == table
    assert not pair.all_resident([("r", 64, 1)])
    _, updates = hs.take_residency_updates(pair.model, ["r"])
    assert updates["r"].pages == (0, 1, 2) and updates["r"].block_ids == ((0, 0, 0),)
    pair.residency(["r"])
    pair.free("r", finished=True)


def test_residency_update_sends_only_changed_pages() -> None:
    """After ``test_hisparse_residency_update_sends_only_changed_pages``: losing one early
    page resends that page only."""
    pair = Pair(24, 16, enable_caching=True)
    _clean_then_hot(pair, "r", 40, num_free_left=1)
    pair.computed("r", 40)
    pair.append("r", [1])
    assert pair.allocate_scheduled("r", 1)
    assert pair.model.hisparse.books["r"].unpinned == {0}  # type: ignore[union-attr]
    pair.residency(["r"])
    pair.press_device(len(pair.model.managers.pool.free_queue))
    _, updates = hs.take_residency_updates(pair.model, ["r"])
    assert updates["r"].pages == (0,) and updates["r"].block_ids == ((0,),)
    pair.residency(["r"])
    pair.residency(["r"])


def test_page_clean_under_a_hot_region_is_unpinned_at_once() -> None:
    """``_page_became_clean``: a spill completing for a request that reads from host unpins
    its page at once, outside the active tail; a lost page's block is not freed again."""
    pair = Pair(40, 16, enable_caching=True)
    pair.request("r", list(range(48)))
    assert pair.allocate_scheduled("r", 48)
    pair.model, _ = hs.require_hot(pair.model, "r")
    for hot in pair.coordinator.hot_managers:
        hot.require_hot("r")
    pair.computed("r", 48)
    pair.append("r", list(range(40)))
    assert pair.allocate_scheduled("r", 40)
    assert pair.model.managers.tables[3].req_to_blocks["r"]
    pair.publish()
    book = pair.model.hisparse.books["r"]  # type: ignore[union-attr]
    assert book.unpinned == {0, 1, 2, 3} and book.pinned_clean == {4}
    pair.press_device(len(pair.model.managers.pool.free_queue))
    pair.free("r", finished=True)
