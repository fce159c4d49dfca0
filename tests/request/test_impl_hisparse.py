"""HiSparse slices 1 and 2 in kvpool.impl (docs/hisparse.md): the layout's checks, the worked
example, publication, hot regions and lost pages, and every refusal by name with the manager
exactly as it was."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvpool.impl import KVCacheConfig, KVCacheManager, get_hisparse_coordinator
from kvpool.model.errors import (
    HiSparseNotModelled,
    InvalidArgument,
    InvalidHiSparseLayout,
    InvalidManagerConfig,
    InvalidTokenCount,
    PoolError,
    UnknownRequest,
)
from kvpool.model.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from kvpool.model.hisparse_types import PageTransfer
from kvpool.model.single_type import full_attention
from tests.request.hisparse_configs import (
    PAGE,
    Config,
    Finished,
    FullAttentionSpec,
    Group,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    coordinator_of,
    fingerprint,
    groups,
    make_manager,
    request,
)


def _publish_all(manager: KVCacheManager) -> None:
    view = get_hisparse_coordinator(manager)
    counts = {t.transfer_id: 1 for t in view.build_offload_command().page_transfers}
    view.update_spills(counts, counts)


def _admit(manager: KVCacheManager, req: Any, num_new_tokens: int) -> Any:
    blocks = manager.allocate_slots(req, num_new_tokens)
    if blocks is not None:
        num = min(req.num_computed_tokens + num_new_tokens, req.num_tokens)
        get_hisparse_coordinator(manager).advance_scheduled([(req.request_id, num)])
    return blocks


# ----------------------------------------------------------------------
# The layout (HiSparseCoordinator.__init__, vLLM 0.33.0)
# ----------------------------------------------------------------------


def test_the_layout_and_its_numbers() -> None:
    manager = make_manager(32, 16, max_model_len=128, max_in_flight_tokens=48)
    layout = manager.hisparse_layout
    assert layout is not None
    assert (layout.source, layout.indexers, layout.residents, layout.hots) == (0, (1,), (2,), (3,))
    assert layout.max_spill_pages == 128 // PAGE
    assert layout.transition_watermark == max(2, 32 // 10)
    assert layout.max_admission_pages == 3
    host = manager.host_block_pool
    assert host is not None and host.medium == MEDIUM_CPU and host.num_gpu_blocks == 16
    view = get_hisparse_coordinator(manager)
    assert view is get_hisparse_coordinator(manager)
    assert view.get_host_block_pool() is host and view.gpu_pool is manager.block_pool


def _config(**changes: Any) -> Config:
    return replace(Config(32, groups(), 16), **changes)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (_config(hisparse_host_num_blocks=None), InvalidHiSparseLayout),
        (_config(hisparse_host_num_blocks=0), InvalidHiSparseLayout),
        (_config(hisparse_host_num_blocks=True), InvalidHiSparseLayout),
        (_config(kv_cache_groups=[*groups(), groups()[0]]), InvalidHiSparseLayout),
        (_config(kv_cache_groups=groups()[1:]), InvalidHiSparseLayout),
        (_config(kv_cache_groups=[groups()[2], *groups()[:2], groups()[3]]), InvalidHiSparseLayout),
        (
            _config(kv_cache_groups=[*groups()[:2], Group(HiSparseResidentSpec(32))]),
            InvalidHiSparseLayout,
        ),
        (
            _config(kv_cache_groups=[*groups(), Group(HiSparseResidentSpec(32))]),
            InvalidHiSparseLayout,
        ),
        (
            _config(
                kv_cache_groups=[*groups()[:2], Group(HiSparseResidentSpec(16), host_resident=True)]
            ),
            InvalidHiSparseLayout,
        ),
        (_config(kv_cache_groups=groups()[:2]), InvalidManagerConfig),
        (_config(kv_cache_groups=[*groups(), Group(FullAttentionSpec(16))]), InvalidManagerConfig),
        (
            _config(kv_cache_groups=[*groups()[:3], Group(HiSparseHotSpec(16, 0))]),
            InvalidManagerConfig,
        ),
        (_config(prefix_cache_retention_interval=16), InvalidManagerConfig),
        (
            _config(
                kv_cache_groups=[
                    *groups()[:1],
                    Group(FullAttentionSpec(16), is_eagle_group=True),
                    *groups()[2:],
                ]
            ),
            InvalidManagerConfig,
        ),
    ],
    ids=[
        "no-host-blocks",
        "zero-host-blocks",
        "bool-host-blocks",
        "two-sources",
        "no-source",
        "source-after-resident",
        "resident-size-differs-from-source",
        "resident-sizes-differ",
        "host-resident-resident",
        "no-resident-group",
        "a-default-group-beside",
        "empty-hot-region",
        "sparse-retention",
        "eagle-group",
    ],
)
def test_invalid_layout(config: Config, error: type[Exception]) -> None:
    with pytest.raises(error):
        KVCacheManager(config, max_model_len=128, hash_block_size=PAGE)


@pytest.mark.parametrize(
    "kwargs",
    [{"use_eagle": True}, {"fine_grained_hits": True}, {"dcp_world_size": 2}],
    ids=["eagle", "fine-grained-hits", "context-parallelism"],
)
def test_invalid_beside_hisparse(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(_config(), max_model_len=128, hash_block_size=PAGE, **kwargs)


def test_invalid_hash_blocks_smaller_than_a_page() -> None:
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(_config(), max_model_len=128, hash_block_size=8)


def test_invalid_no_hisparse_coordinator() -> None:
    manager = KVCacheManager(KVCacheConfig(8, (full_attention(4),)), max_model_len=32)
    with pytest.raises(InvalidHiSparseLayout):
        get_hisparse_coordinator(manager)


def test_invalid_snapshot_of_a_hisparse_manager() -> None:
    with pytest.raises(HiSparseNotModelled):
        make_manager().snapshot()


# ----------------------------------------------------------------------
# The worked example of docs/hisparse.md
# ----------------------------------------------------------------------


def test_one_request_written_back_and_published() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    tokens = list(range(64))
    a = request("a", tokens)
    assert _admit(manager, a, 64) is not None
    assert manager.get_block_ids("a") == ([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [])
    host = view.get_host_block_pool()
    assert [b.ref_cnt for b in host.blocks[1:5]] == [2, 2, 2, 2]
    assert host.get_num_free_blocks() == 11
    transfers = view.build_offload_command().page_transfers
    assert transfers == [PageTransfer(i, i + 1, (i + 5,), after_forward=True) for i in range(4)]
    assert not view.build_offload_command().page_transfers
    # no hit: the indexer has one, the source has none
    assert manager.get_computed_blocks(request("b", tokens))[1] == 0
    view.update_spills({1: 1}, {1: 1})
    assert [b.ref_cnt for b in host.blocks[1:5]] == [2, 1, 2, 2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (5, 6, 7, 8)] == [2, 1, 2, 2]
    state = view.request_states["a"]
    assert (state.valid_pages, state.ready_prefix_pages, state.pinned_clean) == ({1}, 0, {1})
    assert manager.get_computed_blocks(request("b", tokens))[1] == 0
    view.update_spills({0: 1, 2: 1, 3: 1}, {0: 1, 2: 1, 3: 1})
    assert all(b.block_hash is not None for b in host.blocks[1:5])
    assert [manager.block_pool.blocks[i].ref_cnt for i in (5, 6, 7, 8)] == [1, 1, 1, 1]
    assert len(view.copies) == 4 and not view.has_pending_work()
    assert manager.get_computed_blocks(request("b", tokens))[1] == 48
    # no hot region: the clean pages stay pinned; at the free they are unpinned, tail first
    assert manager.block_pool.get_num_free_blocks() == 23
    manager.free(a)
    assert list(b.block_id for b in manager.block_pool.free_block_queue)[-8:] == [
        8,
        7,
        6,
        5,
        4,
        3,
        2,
        1,
    ]
    assert len(view.copies) == 4
    # handing the copies out drops them
    manager.block_pool.get_new_blocks(manager.block_pool.get_num_free_blocks())
    assert not view.copies


def test_events_say_host_and_device() -> None:
    manager = make_manager(32, 16, enable_kv_cache_events=True)
    a = request("a", list(range(64)))
    _admit(manager, a, 64)
    _publish_all(manager)
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert {(e.group_idx, e.medium) for e in stored} == {(0, MEDIUM_CPU), (1, MEDIUM_GPU)}
    view = get_hisparse_coordinator(manager)
    view.host_manager.block_pool.evict_blocks({manager.get_block_ids("a")[0][0]})
    [removed] = manager.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == MEDIUM_CPU
    assert removed.group_idx == 0


def test_a_finished_request_publishes_after_its_last_spill() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    a = request("a", list(range(33)))
    _admit(manager, a, 33)
    counts = {t.transfer_id: 2 for t in view.build_offload_command().page_transfers}
    assert len(counts) == 2
    host_blocks = list(manager.get_blocks("a").blocks[0])
    # transfer 0 completed by both workers, transfer 1 by one: page 0 is published
    view.update_spills(counts, {0: 2, 1: 1})
    manager.free(Finished(a))
    assert host_blocks[0].block_hash is not None and host_blocks[1].block_hash is None
    assert host_blocks[1].ref_cnt == 2  # the detached publication's and the spill's
    # the id is reused: the old completion lands on the detached publication
    b = request("a", list(range(100, 117)))
    _admit(manager, b, 17)
    view.update_spills({}, {1: 1})
    assert host_blocks[1].block_hash is not None
    assert all(block.ref_cnt == 0 for block in host_blocks[:2])
    assert manager.get_computed_blocks(request("p", list(range(33))))[1] == 32


def test_a_request_freed_unfinished_drops_its_publication() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    a = request("a", list(range(33)))
    _admit(manager, a, 33)
    counts = {t.transfer_id: 1 for t in view.build_offload_command().page_transfers}
    host_blocks = list(manager.get_blocks("a").blocks[0])
    manager.free(a)
    view.update_spills(counts, counts)
    assert all(b.block_hash is None and b.ref_cnt == 0 for b in host_blocks)
    assert not view.has_pending_work()


def test_spill_budget_and_reprefillable_tokens() -> None:
    manager = make_manager(32, 16, num_prefill_lookahead=3, enable_caching=False)
    view = get_hisparse_coordinator(manager)
    _admit(manager, request("a", list(range(32))), 32)
    assert len(view.build_offload_command().page_transfers) == 1  # the MTP tail stays
    view.max_spill_pages = 1
    view.plan_prefix_materialization("a", 32)
    assert [t.transfer_id for t in view.build_offload_command().page_transfers] == [1]


def test_host_exhaustion_answers_none_and_changes_nothing() -> None:
    manager = make_manager(32, 3)
    before = fingerprint(manager)
    assert manager.allocate_slots(request("a", list(range(64))), 64) is None
    assert fingerprint(manager) == before


def test_full_sequence_counts_resident_pages_up_to_the_window() -> None:
    manager = make_manager(11, 9, max_model_len=128, max_in_flight_tokens=32)
    r = request("long", list(range(128)))
    # 8 indexer pages, 2 resident pages (the window), no hot region: 10 of 10 free
    assert manager.allocate_slots(r, PAGE, full_sequence_must_fit=True) is not None


def test_rows_mirrors_and_residency_updates() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    _admit(manager, request("a", list(range(32))), 32)
    resident = view.resident_managers[0].req_to_blocks["a"]
    host = view.host_manager.req_to_blocks["a"]
    mirrors = view.build_row_mirrors([("a", 14, 4)])
    assert [(m.source_starts, m.destination_start, m.num_rows) for m in mirrors] == [
        ((resident[0].block_id * PAGE + 14,), host[0].block_id * PAGE + 14, 2),
        ((resident[1].block_id * PAGE,), host[1].block_id * PAGE, 2),
    ]
    update = view.take_residency_updates(["a"])["a"]
    assert update.pages == [0, 1] and update.block_ids == ([b.block_id for b in resident],)
    assert view.take_residency_updates(["a"]) == {}
    assert view.all_context_pages_resident([("a", 31, 1)])
    assert not view.all_context_pages_resident([("a", 32, 1)])


def test_a_prefill_filling_its_window_takes_its_hot_region_and_unpins() -> None:
    manager = make_manager(32, 16, max_in_flight_tokens=64)
    view = get_hisparse_coordinator(manager)
    r = request("p", list(range(128)))
    _admit(manager, r, 64)
    assert "p" in view.hot_managers[0].hot_required
    assert not view.hot_managers[0].has_hot("p")
    # the next allocation takes the whole region (2 blocks) after the other groups' blocks
    assert _admit(manager, replace(r, num_computed_tokens=64), 16) is not None
    assert manager.get_block_ids("p") == (
        [1, 2, 3, 4, 5],
        [1, 2, 3, 4, 9],
        [5, 6, 7, 8, 10],
        [11, 12],
    )
    assert view.hot_managers[0].has_hot("p")
    free = manager.block_pool.get_num_free_blocks()
    # clean pages unpin as their spills complete, except the active tail (pages 3 and 4)
    _publish_all(manager)
    state = view.request_states["p"]
    assert (state.unpinned_pages, state.pinned_clean) == ({0, 1, 2}, {3, 4})
    assert [manager.block_pool.blocks[i].ref_cnt for i in (5, 6, 7, 8, 10)] == [0, 0, 0, 1, 1]
    assert manager.block_pool.get_num_free_blocks() == free + 3
    # still read until reused: the worker is sent the blocks, all pages resident
    assert view.take_residency_updates(["p"])["p"].block_ids == ([5, 6, 7, 8, 10],)
    assert view.all_context_pages_resident([("p", 79, 1)])
    # reusing them loses the pages: host-only, stale for the worker; the table is unchanged
    manager.block_pool.get_new_blocks(manager.block_pool.get_num_free_blocks())
    assert state.unpinned_pages == set()
    assert [b.block_id for b in view.resident_managers[0].get_residency_row("p")] == [
        0,
        0,
        0,
        8,
        10,
    ]
    assert manager.get_block_ids("p")[2] == [5, 6, 7, 8, 10]
    assert not view.all_context_pages_resident([("p", 79, 1)])
    update = view.take_residency_updates(["p"])["p"]
    assert (update.pages, update.block_ids) == ([0, 1, 2], ([0, 0, 0],))
    assert view.take_residency_updates(["p"]) == {}
    # the free releases the pinned pages and the region, not the lost pages a second time
    manager.free(r)
    assert [manager.block_pool.blocks[i].ref_cnt for i in (8, 10, 11, 12)] == [0, 0, 0, 0]


def test_a_clean_page_outside_the_tail_unpins_at_the_next_residency_update() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    r = request("a", list(range(80)))
    _admit(manager, r, 64)
    _publish_all(manager)
    state = view.request_states["a"]
    assert state.pinned_clean == {0, 1, 2, 3} and not state.unpinned_pages
    view.require_hot("a")
    assert manager.allocate_slots(replace(r, num_computed_tokens=64), 1) is not None
    assert view.hot_managers[0].has_hot("a") and state.pinned_clean == {0, 1, 2, 3}
    # 5 pages now: the active tail is pages 3 and 4
    view.update_residency("a")
    assert (state.unpinned_pages, state.pinned_clean) == ({0, 1, 2}, {3})


def test_the_region_given_directly_with_vllm_s_three_arguments() -> None:
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    _admit(manager, request("a", list(range(64))), 64)
    _publish_all(manager)
    hot = view.hot_managers[0]
    assert hot.allocate_new_blocks("a", 64, 64) == []  # not required: nothing
    hot.require_hot("a")
    assert len(hot.allocate_new_blocks("a", 64, 64)) == hot.blocks_per_request
    assert hot.allocate_new_blocks("a", 64, 64) == []  # whole already
    view.update_residency("a")
    assert view.request_states["a"].unpinned_pages == {0, 1}
    rows = view.resident_managers[0].req_to_blocks["a"]
    assert [b.ref_cnt for b in rows] == [0, 0, 1, 1]


def test_a_hot_region_that_does_not_fit_answers_none() -> None:
    manager = make_manager(9, 16)
    view = get_hisparse_coordinator(manager)
    r = request("a", list(range(64)))
    assert _admit(manager, r, 48) is not None  # 3 indexer + 3 resident of 8
    view.require_hot("a")
    before = fingerprint(manager)
    assert manager.allocate_slots(replace(r, num_computed_tokens=48), 1) is None
    assert fingerprint(manager) == before


# ----------------------------------------------------------------------
# Refusals: a named error, the manager exactly as it was
# ----------------------------------------------------------------------


def _running() -> tuple[KVCacheManager, Any]:
    manager = make_manager(32, 16)
    a = request("a", list(range(64)))
    _admit(manager, a, 64)
    return manager, a


def _refused(manager: KVCacheManager, call: Any, error: type[Exception]) -> None:
    before = fingerprint(manager)
    with pytest.raises(error):
        call()
    assert fingerprint(manager) == before


def test_invalid_host_hit_is_not_modelled() -> None:
    manager, a = _running()
    _publish_all(manager)
    manager.free(a)
    b = request("b", list(range(64)))
    hits, num = manager.get_computed_blocks(b)[:2]
    assert num == 48 and len(hits.blocks[0]) == 3
    _refused(manager, lambda: manager.allocate_slots(b, 16, num, hits), HiSparseNotModelled)


def test_a_retained_source_hit_beyond_the_reused_tokens_is_cut() -> None:
    manager, a = _running()
    _publish_all(manager)
    manager.free(a)
    manager.evict_blocks({manager.block_pool.blocks[1].block_id})  # the indexer's first
    b = request("b", list(range(64)))
    hits, num = manager.get_computed_blocks(b)[:2]
    assert num == 0 and len(hits.blocks[0]) == 3  # the source keeps its longer hit
    assert manager.allocate_slots(b, 64, 0, hits) is not None


def test_invalid_external_tokens_are_not_modelled() -> None:
    manager, _ = _running()
    b = request("b", list(range(64)))
    _refused(
        manager,
        lambda: manager.allocate_slots(b, 16, num_external_computed_tokens=16),
        HiSparseNotModelled,
    )


@pytest.mark.parametrize(
    ("pairs", "error"),
    [
        ([("ghost", 16)], UnknownRequest),
        ([("a", 16), ("ghost", 16)], UnknownRequest),
        ([("a", -1)], InvalidTokenCount),
        ([("a", 1.5)], InvalidArgument),
        ([("a",)], InvalidArgument),
        ([(1, 16)], InvalidArgument),
        ("a", InvalidArgument),
        (None, InvalidArgument),
    ],
    ids=["unknown", "unknown-after-known", "negative", "float", "short", "int-id", "str", "none"],
)
def test_invalid_advance_scheduled(pairs: Any, error: type[Exception]) -> None:
    manager, _ = _running()
    view = get_hisparse_coordinator(manager)
    view.build_offload_command()
    _refused(manager, lambda: view.advance_scheduled(pairs), error)


@pytest.mark.parametrize(
    ("enqueued", "completed"),
    [({0: 0}, {}), ({"0": 1}, {}), ({}, {0: True}), ([], {}), ({0: 1}, None)],
    ids=["zero", "str-id", "bool-count", "list", "none"],
)
def test_invalid_update_spills(enqueued: Any, completed: Any) -> None:
    manager, _ = _running()
    view = get_hisparse_coordinator(manager)
    view.build_offload_command()
    _refused(manager, lambda: view.update_spills(enqueued, completed), InvalidArgument)


def test_update_spills_ignores_unknown_transfers() -> None:
    manager, _ = _running()
    view = get_hisparse_coordinator(manager)
    before = fingerprint(manager)
    view.update_spills({99: 1}, {99: 1})
    assert fingerprint(manager) == before


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda v: v.plan_prefix_materialization("a", -1), InvalidTokenCount),
        (lambda v: v.plan_prefix_materialization("ghost", 16), UnknownRequest),
        (lambda v: v.update_residency("ghost"), UnknownRequest),
        (lambda v: v.require_hot("ghost"), UnknownRequest),
        (lambda v: v.take_residency_updates(["a", "ghost"]), UnknownRequest),
        (lambda v: v.take_residency_updates("a"), InvalidArgument),
        (lambda v: v.build_row_mirrors([("a", -1, 2)]), InvalidTokenCount),
        (lambda v: v.build_row_mirrors([("a", 1)]), InvalidArgument),
        (lambda v: v.all_context_pages_resident([("a", 0, "1")]), InvalidArgument),
        (lambda v: setattr(v, "max_spill_pages", -1), InvalidArgument),
        (lambda v: setattr(v, "max_spill_pages", "2"), InvalidArgument),
        (lambda v: v.resident_managers[0].get_residency_row("a", -1), InvalidArgument),
        (lambda v: v.hot_managers[0].require_hot(None), InvalidArgument),
        (lambda v: v.complete_host_import("a", 16), HiSparseNotModelled),
    ],
    ids=[
        "plan-negative",
        "plan-unknown",
        "residency-unknown",
        "require-hot-unknown",
        "updates-unknown",
        "updates-str",
        "mirrors-negative",
        "mirrors-short",
        "resident-str-count",
        "budget-negative",
        "budget-str",
        "row-negative-start",
        "hot-none-id",
        "host-import",
    ],
)
def test_invalid_coordinator_call(call: Any, error: type[Exception]) -> None:
    manager, _ = _running()
    view = get_hisparse_coordinator(manager)
    _refused(manager, lambda: call(view), error)


def _reading_from_host() -> tuple[KVCacheManager, Any]:
    """A request holding its hot region, pages 0-2 unpinned, 3-4 pinned (the active tail)."""
    manager = make_manager(32, 16)
    view = get_hisparse_coordinator(manager)
    a = request("a", list(range(96)))
    _admit(manager, a, 64)
    view.require_hot("a")
    a = replace(a, num_computed_tokens=64)
    assert _admit(manager, a, 16) is not None
    _publish_all(manager)
    assert view.request_states["a"].unpinned_pages == {0, 1, 2}
    return manager, replace(a, num_computed_tokens=80)


@pytest.mark.parametrize(
    "call",
    [
        lambda v: v.advance_scheduled([("a", 80), ("ghost", 16)]),
        lambda v: v.advance_scheduled([("a", 80), ("a", -1)]),
        lambda v: v.update_residency(None),
        lambda v: v.take_residency_updates(["a", "ghost"]),
        lambda v: v.all_context_pages_resident([("a", 79, 1), ("a", 1)]),
        lambda v: v.update_spills({0: 1}, {0: 0}),
    ],
    ids=[
        "advance-ghost",
        "advance-negative",
        "residency-none",
        "updates-ghost",
        "resident-short",
        "acks-zero",
    ],
)
def test_invalid_call_on_a_request_reading_from_host(call: Any) -> None:
    manager, _ = _reading_from_host()
    _refused(manager, lambda: call(get_hisparse_coordinator(manager)), PoolError)


def test_a_hot_region_that_no_longer_fits_after_losing_pages_answers_none() -> None:
    manager, a = _reading_from_host()
    view = get_hisparse_coordinator(manager)
    pool = manager.block_pool
    held = pool.get_new_blocks(pool.get_num_free_blocks())
    assert view.request_states["a"].unpinned_pages == set()
    assert "a" in view.hot_managers[0].hot_required
    # the region is held: a lost page asks for nothing more; a full pool refuses the next page
    before = fingerprint(manager)
    assert manager.allocate_slots(a, 16) is None
    assert fingerprint(manager) == before
    pool.free_blocks(held)


def test_invalid_cache_blocks_of_an_unknown_request() -> None:
    manager, _ = _running()
    _refused(manager, lambda: manager.cache_blocks(request("ghost", [1] * 32), 32), UnknownRequest)


def test_a_refused_reset_resets_neither_pool() -> None:
    manager, a = _running()
    _publish_all(manager)
    manager.free(a)
    held = manager.block_pool.get_new_blocks(1)
    before = fingerprint(manager)
    assert not manager.reset_prefix_cache()
    assert fingerprint(manager) == before
    manager.block_pool.free_blocks(held)
    view = get_hisparse_coordinator(manager)
    assert view.copies and manager.reset_prefix_cache()
    assert not view.copies
    assert all(b.block_hash is None for b in view.get_host_block_pool().blocks)


def test_a_reset_under_a_request_reading_from_host_is_refused() -> None:
    manager, a = _reading_from_host()
    before = fingerprint(manager)
    # its unpinned pages count as free, but its region and tail are held: refused
    assert not manager.reset_prefix_cache()
    assert fingerprint(manager) == before
    view = get_hisparse_coordinator(manager)
    manager.free(a)
    # the freed request's pages, unpinned before or at the free, are only copies now
    assert view.copies and manager.reset_prefix_cache()
    assert not view.copies and not view.request_states


def test_pop_blocks_for_free_hands_host_blocks_to_their_pool() -> None:
    manager = make_manager(16, 16)
    host = get_hisparse_coordinator(manager).get_host_block_pool()
    r = request("r", list(range(16)))
    assert manager.allocate_slots(r, 16, delay_cache_blocks=True) is not None
    blocks = manager.pop_blocks_for_free(r)
    assert any(host.blocks[b.block_id] is b for b in blocks)
    manager.block_pool.free_blocks(reversed(blocks))
    assert host.get_num_free_blocks() == 15 and manager.block_pool.get_num_free_blocks() == 15
    assert coordinator_of(manager).request_states == {}


def test_invalid_event_owner() -> None:
    from kvpool.impl import BlockPool

    with pytest.raises(InvalidArgument):
        BlockPool(4, True, 1, event_owner=object())


def test_an_owned_pool_queues_into_its_owner_s_queue_by_the_owner_s_hook() -> None:
    from kvpool.impl import BlockPool
    from kvpool.model.events import AllBlocksCleared

    def made(event: Any, request: Any) -> Any:
        return ("made", event)

    owner = BlockPool(4, True, 1, enable_kv_cache_events=True, event_hook=made)
    host = BlockPool(4, True, 1, enable_kv_cache_events=True, medium=MEDIUM_CPU, event_owner=owner)
    assert host.reset_prefix_cache()
    assert host.take_events() == [] and host.kv_event_queue == []
    taken: list[Any] = list(owner.take_events())
    assert taken == [("made", AllBlocksCleared())]
