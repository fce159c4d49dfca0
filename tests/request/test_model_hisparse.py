"""kvpool's HiSparse model, slice 1 (docs/hisparse.md): the layout's refusals, each
operation's preconditions (the state unchanged after a refusal), and the two worked
examples, whose numbers are vLLM 0.33.0's answers."""

from dataclasses import replace
from typing import Any

import pytest

import kvpool.model.hisparse as hs
import kvpool.model.hisparse_core as core
import kvpool.model.manager as mgr
import kvpool.model.pool as pool_ops
import kvpool.model.scheduler_calls as calls
from kvpool.model.errors import (
    HiSparseNotModelled,
    InvalidArgument,
    InvalidHiSparseLayout,
    InvalidTokenCount,
    UnknownBlock,
    UnknownRequest,
)
from kvpool.model.events import BlockStored
from kvpool.model.hisparse_layout import HiSparseConfig
from kvpool.model.request import Request, new_request
from kvpool.model.single_type import KVCacheSpec, full_attention, sliding_window
from tests.request.hisparse_pair import BLOCK, model_config, new_model

FOUR = [full_attention(BLOCK)] * 4


def _build(config: HiSparseConfig, specs: list[KVCacheSpec] | None = None, **kwargs: Any) -> None:
    mgr.new_hisparse_manager(32, specs or FOUR, 128, config, hash_block_size=BLOCK, **kwargs)


BASE = replace(model_config(), host_num_blocks=16)

# --------------------------------------------------------------------------
# The layout
# --------------------------------------------------------------------------


def test_layout_numbers() -> None:
    m = new_model(32, 16, max_in_flight_tokens=40)
    layout = m.config.hisparse
    assert layout is not None
    assert (layout.max_spill_pages, layout.transition_watermark, layout.max_admission_pages) == (
        8,
        3,
        3,
    )
    assert m.host_pool is not None and m.host_pool.config.medium == "CPU"
    assert m.managers.pool.config.medium == "GPU"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(replace(BASE, source_groups=()), id="no_source"),
        pytest.param(replace(BASE, source_groups=(0, 1), indexer_groups=()), id="two_sources"),
        pytest.param(replace(BASE, host_num_blocks=None), id="no_host_capacity"),
        pytest.param(replace(BASE, host_num_blocks=0), id="host_pool_without_blocks"),
        pytest.param(HiSparseConfig((2,), 16, (0,), (1,), ((3, 2),)), id="source_after_resident"),
        pytest.param(replace(BASE, indexer_groups=(7,)), id="role_out_of_range"),
        pytest.param(replace(BASE, indexer_groups=(1, 2)), id="two_roles"),
        pytest.param(replace(BASE, hot_groups=((3, 0),)), id="empty_hot_region"),
    ],
)
def test_invalid_layout(config: HiSparseConfig) -> None:
    with pytest.raises(InvalidHiSparseLayout):
        _build(config)


def test_invalid_resident_block_sizes_differ() -> None:
    config = HiSparseConfig((0,), 16, (1,), (2, 3), ((4, 2),))
    specs = [full_attention(16)] * 3 + [full_attention(32), full_attention(16)]
    with pytest.raises(InvalidHiSparseLayout, match="one block size"):
        _build(config, specs)


def test_invalid_resident_block_size_not_the_source() -> None:
    specs = [full_attention(32), full_attention(16), full_attention(16), full_attention(16)]
    with pytest.raises(InvalidHiSparseLayout, match="must match"):
        _build(BASE, specs)


def test_invalid_role_on_a_sliding_window_group() -> None:
    with pytest.raises(InvalidHiSparseLayout):
        _build(BASE, [*FOUR[:3], sliding_window(BLOCK, 32)])


@pytest.mark.parametrize(
    "config,specs",
    [
        pytest.param(BASE, [*FOUR, full_attention(BLOCK)], id="group_without_role"),
        pytest.param(
            HiSparseConfig((0,), 16, (1,), (), ((2, 2),)), FOUR[:3], id="no_resident_group"
        ),
        pytest.param(BASE, [*FOUR[:3], full_attention(2 * BLOCK)], id="hot_group_of_another_size"),
    ],
)
def test_layout_not_modelled(config: HiSparseConfig, specs: list[KVCacheSpec]) -> None:
    with pytest.raises(HiSparseNotModelled):
        _build(config, specs)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"use_eagle": True}, id="eagle"),
        pytest.param({"retention_interval": 0}, id="sparse_retention"),
        pytest.param({"dcp_world_size": 2}, id="decode_context_parallel"),
        pytest.param({"fine_grained_hits": True}, id="fine_grained_hits"),
    ],
)
def test_feature_beside_hisparse_not_modelled(kwargs: dict[str, Any]) -> None:
    with pytest.raises(HiSparseNotModelled):
        _build(BASE, **kwargs)


def test_multi_module_mtp_lookahead_is_accepted() -> None:
    m = new_model(32, 16, num_prefill_lookahead=3)
    assert m.config.hisparse is not None and m.config.hisparse.num_reprefillable_tokens == 2


def test_coordinator_call_on_a_manager_without_hisparse() -> None:
    m = mgr.new_kv_cache_manager(8, [full_attention(BLOCK)], 64)
    with pytest.raises(InvalidHiSparseLayout):
        hs.build_offload_command(m)


# --------------------------------------------------------------------------
# The worked examples (docs/hisparse.md; the numbers are vLLM 0.33.0's)
# --------------------------------------------------------------------------


def _request(request_id: str, num_tokens: int = 64) -> Request:
    return new_request(request_id, list(range(num_tokens)), BLOCK)


def _rows(m: mgr.KVCacheManagerState, pool: str, ids: tuple[int, ...]) -> list[tuple[int, int]]:
    blocks = (m.host_pool if pool == "host" else m.managers.pool).blocks  # type: ignore[union-attr]
    return [(blocks[b].ref_cnt, int(blocks[b].block_hash is not None)) for b in ids]


def _admitted() -> mgr.KVCacheManagerState:
    m = new_model(32, 16, enable_caching=True)
    m, blocks = mgr.allocate_slots(m, _request("a"), 64)
    assert blocks == ((1, 2, 3, 4), (1, 2, 3, 4), (5, 6, 7, 8), ())
    m, _ = hs.advance_scheduled(m, [("a", 64)])
    return m


def test_worked_example_one_request_written_back_and_published() -> None:
    m = _admitted()
    assert _rows(m, "host", (1, 2, 3, 4)) == [(2, 0)] * 4
    assert _rows(m, "device", (1, 2, 3, 4)) == [(1, 1)] * 4
    assert _rows(m, "device", (5, 6, 7, 8)) == [(2, 0)] * 4
    assert m.host_pool is not None and len(m.host_pool.free_queue) == 11
    assert mgr.num_free_blocks(m) == 23
    assert hs.hot_required(m) == frozenset()
    m, transfers = hs.build_offload_command(m)
    assert [(t.transfer_id, t.host_block_id, t.resident_block_ids) for t in transfers] == [
        (0, 1, (5,)),
        (1, 2, (6,)),
        (2, 3, (7,)),
        (3, 4, (8,)),
    ]
    assert mgr.get_computed_blocks(m, _request("b"))[1][1] == 0
    m, _ = hs.update_spills(m, {1: 1}, {1: 1})
    assert _rows(m, "host", (1, 2, 3, 4)) == [(2, 0), (1, 0), (2, 0), (2, 0)]
    assert _rows(m, "device", (5, 6, 7, 8)) == [(2, 0), (1, 0), (2, 0), (2, 0)]
    assert m.hisparse is not None
    book = m.hisparse.books["a"]
    assert (book.valid, book.ready_prefix_pages, book.pinned_clean) == (
        frozenset({1}),
        0,
        frozenset({1}),
    )
    assert mgr.get_computed_blocks(m, _request("b"))[1][1] == 0
    m, _ = hs.update_spills(m, {0: 1, 2: 1, 3: 1}, {0: 1, 2: 1, 3: 1})
    assert _rows(m, "host", (1, 2, 3, 4)) == [(1, 1)] * 4
    assert _rows(m, "device", (5, 6, 7, 8)) == [(1, 0)] * 4
    assert m.hisparse is not None
    book = m.hisparse.books["a"]
    assert (book.valid, book.ready_prefix_pages) == (frozenset({0, 1, 2, 3}), 4)
    assert len(hs.copies(m)) == 4
    assert mgr.get_computed_blocks(m, _request("b"))[1][1] == 48
    m, _ = mgr.free(m, "a", finished=True)
    assert m.managers.pool.free_queue[-9:] == (31, 8, 7, 6, 5, 4, 3, 2, 1)


def test_worked_example_the_same_prompt_again_hits_then_is_refused() -> None:
    """The hit of the second example is vLLM's; admitting it is slice 3's, refused by name."""
    m = _admitted()
    m, transfers = hs.build_offload_command(m)
    counts = {t.transfer_id: 1 for t in transfers}
    m, _ = hs.update_spills(m, counts, counts)
    m, _ = mgr.free(m, "a", finished=True)
    d = _request("d")
    m, (hit, num_tokens) = mgr.get_computed_blocks(m, d)
    assert (tuple(map(len, hit)), num_tokens) == ((3, 3, 0, 0), 48)
    with pytest.raises(HiSparseNotModelled):
        mgr.allocate_slots(m, d, 16, num_new_computed_tokens=48, new_computed_blocks=hit)
    # the source's longer hit is cut to the tokens used: none here, and no hit is taken
    m2, blocks = mgr.allocate_slots(m, d, 64, new_computed_blocks=((1, 2, 3), (), (), ()))
    assert blocks is not None and blocks[0] == (5, 6, 7, 8)
    assert m2.host_pool is not None and m2.host_pool.blocks[1].ref_cnt == 0


def test_host_and_device_events_share_one_queue_in_order() -> None:
    m = new_model(32, 16, enable_caching=True, enable_events=True)
    m, _ = mgr.allocate_slots(m, _request("a", 32), 32)
    m, _ = hs.advance_scheduled(m, [("a", 32)])
    m, transfers = hs.build_offload_command(m)
    counts = {t.transfer_id: 1 for t in transfers}
    m, _ = hs.update_spills(m, counts, counts)
    m, events = mgr.take_events(m)
    assert [(e.medium, len(e.block_hashes)) for e in events if isinstance(e, BlockStored)] == [
        ("GPU", 2),
        ("CPU", 2),
    ]
    assert mgr.take_events(m)[1] == ()


# --------------------------------------------------------------------------
# Preconditions: a refusal leaves the state as it was
# --------------------------------------------------------------------------


def _running() -> mgr.KVCacheManagerState:
    m = new_model(32, 16, enable_caching=True)
    m, _ = mgr.allocate_slots(m, _request("a", 40), 40)
    return m


def test_invalid_external_tokens_beside_hisparse() -> None:
    m = _running()
    before = m
    with pytest.raises(HiSparseNotModelled):
        mgr.allocate_slots(m, _request("x"), 0, num_external_computed_tokens=32)
    assert m == before


def test_hot_region_allocated_once_required() -> None:
    """Slice 2: a request marked hot_required gets its region at its next allocation, once
    (``HiSparseHotManager.allocate_new_blocks``, vLLM 0.33.0)."""
    m = _running()
    m, _ = hs.require_hot(m, "a")
    m, blocks = mgr.allocate_slots(m, replace(_request("a", 41), num_computed_tokens=40), 1)
    assert blocks is not None and len(blocks[3]) == 2
    assert m.managers.tables[3].req_to_blocks["a"] == blocks[3]
    m, again = mgr.allocate_slots(m, replace(_request("a", 42), num_computed_tokens=41), 1)
    assert again is not None and again[3] == ()


def test_hot_region_that_does_not_fit_is_answered_none() -> None:
    m = new_model(10, 16)
    m, _ = mgr.allocate_slots(m, _request("a", 64), 64)
    m, _ = hs.require_hot(m, "a")
    m, blocks = mgr.allocate_slots(m, replace(_request("a", 65), num_computed_tokens=64), 1)
    assert blocks is None


def test_host_exhaustion_answers_none_and_changes_nothing() -> None:
    m = new_model(32, 4)
    before = m
    m, blocks = mgr.allocate_slots(m, _request("a"), 64)
    assert blocks is None and m == before


@pytest.mark.parametrize(
    "pairs,error",
    [
        pytest.param([("a", -1)], InvalidTokenCount, id="negative_tokens"),
        pytest.param([("a", 1.5)], InvalidArgument, id="tokens_not_int"),
        pytest.param([(3, 1)], InvalidArgument, id="id_not_str"),
        pytest.param([("a",)], InvalidArgument, id="not_a_pair"),
        pytest.param(5, InvalidArgument, id="not_iterable"),
    ],
)
def test_invalid_advance_scheduled(pairs: Any, error: type[Exception]) -> None:
    m = _running()
    before = m
    with pytest.raises(error):
        hs.advance_scheduled(m, pairs)
    assert m == before


def test_invalid_plan_prefix_materialization_negative() -> None:
    m = _running()
    with pytest.raises(InvalidTokenCount):
        hs.plan_prefix_materialization(m, "a", -16)


@pytest.mark.parametrize(
    "enqueued,completed",
    [
        pytest.param({0: 0}, {}, id="zero_count"),
        pytest.param({}, {"0": 1}, id="id_not_int"),
        pytest.param({0: True}, {}, id="count_not_int"),
        pytest.param([(0, 1)], {}, id="not_a_mapping"),
    ],
)
def test_invalid_update_spills(enqueued: Any, completed: Any) -> None:
    m = _running()
    m, _ = hs.advance_scheduled(m, [("a", 40)])
    before = m
    with pytest.raises(InvalidArgument):
        hs.update_spills(m, enqueued, completed)
    assert m == before


def test_update_spills_ignores_unknown_ids() -> None:
    m = _running()
    assert hs.update_spills(m, {9: 1}, {9: 1})[0] == m


@pytest.mark.parametrize(
    "spans",
    [
        pytest.param([("a", -1, 1)], id="negative"),
        pytest.param([("a", 1)], id="not_a_span"),
        pytest.param([(1, 1, 1)], id="id_not_str"),
    ],
)
def test_invalid_spans(spans: Any) -> None:
    m = _running()
    before = m
    with pytest.raises((InvalidArgument, InvalidTokenCount)):
        hs.build_row_mirrors(m, spans)
    with pytest.raises((InvalidArgument, InvalidTokenCount)):
        hs.all_context_pages_resident(m, spans)
    assert m == before


def test_invalid_residency_update_ids() -> None:
    m = _running()
    with pytest.raises(InvalidArgument):
        hs.take_residency_updates(m, [1])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: hs.advance_scheduled(m, [("ghost", 16)]), id="advance"),
        pytest.param(
            lambda m: hs.advance_scheduled(m, [("a", 40), ("ghost", 16)]), id="advance_after_known"
        ),
        pytest.param(lambda m: hs.plan_prefix_materialization(m, "ghost", 16), id="plan"),
        pytest.param(lambda m: hs.update_residency(m, "ghost"), id="residency"),
        pytest.param(lambda m: hs.require_hot(m, "ghost"), id="require_hot"),
        pytest.param(lambda m: hs.take_residency_updates(m, ["a", "ghost"]), id="updates"),
    ],
)
def test_invalid_unknown_request(call: Any) -> None:
    """The spec refuses an id holding no source block; vLLM 0.33.0 creates a book for it
    (``_get_request_state``): a recorded difference (docs/hisparse.md)."""
    m = _running()
    before = m
    with pytest.raises(UnknownRequest):
        call(m)
    assert m == before
    assert m.hisparse is not None and "ghost" not in m.hisparse.books


def test_queries_skip_unknown_ids() -> None:
    m = _running()
    assert hs.build_row_mirrors(m, [("ghost", 0, 4)]) == ()
    after, resident = hs.all_context_pages_resident(m, [("ghost", 0, 4)])
    assert not resident  # vLLM 0.33.0: an id without a state has no resident page
    assert after.hisparse is not None and "ghost" not in after.hisparse.books


def test_invalid_free_pool_blocks() -> None:
    m = _running()
    m, popped = hs.pop_blocks_for_free(m, "a")
    before = m
    with pytest.raises(UnknownBlock):
        hs.free_pool_blocks(m, [*popped, ("CPU", 99)])
    with pytest.raises(InvalidArgument):
        hs.free_pool_blocks(m, [("disk", 1)])
    assert m == before
    m, _ = hs.free_pool_blocks(m, popped[::-1])
    assert mgr.num_free_blocks(m) == 31


def test_plain_pop_blocks_for_free_refuses_two_pools() -> None:
    m = _running()
    before = m
    with pytest.raises(HiSparseNotModelled):
        calls.pop_blocks_for_free(m, "a")
    assert m == before


def test_a_refused_reset_resets_neither_pool() -> None:
    """A failed operation leaves the state unchanged: with the device pool busy, the idle
    host pool keeps its hashes too (vLLM 0.33.0 forgets them: a recorded finding,
    docs/hisparse.md; tests/vllm/test_vllm_hisparse.py pins vLLM's answer)."""
    m = _admitted()
    m, transfers = hs.build_offload_command(m)
    counts = {t.transfer_id: 1 for t in transfers}
    m, _ = hs.update_spills(m, counts, counts)
    m, _ = mgr.free(m, "a", finished=True)
    # hold one device block, as vLLM's reproduction does
    t, _ = core.device_pool(mgr.tiers(m), lambda p: pool_ops.get_new_blocks(p, 1))
    m = mgr.with_tiers(m, t)
    before = m
    m, done = mgr.reset_prefix_cache(m)
    assert not done
    assert m == before
    assert m.host_pool is not None
    assert sum(b.block_hash is not None for b in m.host_pool.blocks) == 4
    assert len(hs.copies(m)) == 4


def test_a_refused_host_reset_keeps_the_device_pool() -> None:
    m = _admitted()
    m, transfers = hs.build_offload_command(m)
    counts = {t.transfer_id: 1 for t in transfers}
    m, _ = hs.update_spills(m, counts, counts)
    m, _ = mgr.free(m, "a", finished=True)
    t, _ = core.host_pool(mgr.tiers(m), lambda p: pool_ops.get_new_blocks(p, 1))
    m = mgr.with_tiers(m, t)
    before = m
    m, done = mgr.reset_prefix_cache(m)
    assert not done and m == before


# --------------------------------------------------------------------------
# Slice 2: hot regions, unpinning, losing pages (no vLLM needed)
# --------------------------------------------------------------------------


def _reading_from_host() -> mgr.KVCacheManagerState:
    """Request "a": 4 clean pages, a hot region, pages 0 to 2 unpinned (3 and 4: active tail)."""
    m = new_model(40, 16, enable_caching=True)
    m, _ = mgr.allocate_slots(m, _request("a", 64), 64)
    m, _ = hs.advance_scheduled(m, [("a", 64)])
    m, transfers = hs.build_offload_command(m)
    counts = {x.transfer_id: 1 for x in transfers}
    m, _ = hs.update_spills(m, counts, counts)
    m, _ = hs.require_hot(m, "a")
    m, _ = mgr.allocate_slots(m, replace(_request("a", 65), num_computed_tokens=64), 1)
    m, _ = hs.advance_scheduled(m, [("a", 65)])
    return m


@pytest.mark.parametrize("broken", ["reader_missing", "still_pinned", "stale_unsent"])
def test_slice2_invariants_catch_a_broken_book(broken: str) -> None:
    from kvpool.specs.request.hisparse_invariants import check_hisparse

    m = _reading_from_host()
    check_hisparse(m)
    assert m.hisparse is not None
    book = m.hisparse.books["a"]
    if broken == "reader_missing":
        hisparse = replace(m.hisparse, owners={})
    elif broken == "still_pinned":
        changed = replace(book, pinned_clean=book.pinned_clean | {0})
        hisparse = replace(m.hisparse, books={"a": changed})
    else:
        changed = replace(book, stale=frozenset({book.synced_pages}))
        hisparse = replace(m.hisparse, books={"a": changed})
    with pytest.raises(AssertionError):
        check_hisparse(replace(m, hisparse=hisparse))


def test_unpinned_pages_are_lost_on_reuse_and_free_gives_back_nothing_twice() -> None:
    """A request that reads from host unpins its clean pages outside the active tail; the
    pool's reuse loses them (host-only, asked for a hot region again, stale); its free
    then frees only the blocks it still holds. The slice's invariants hold throughout."""
    from kvpool.specs.request.hisparse_invariants import check_hisparse

    m = _reading_from_host()
    hot = m.managers.tables[3].req_to_blocks["a"]
    assert len(hot) == 2
    check_hisparse(m)
    assert m.hisparse is not None
    book = m.hisparse.books["a"]
    assert (book.unpinned, book.pinned_clean) == (frozenset({0, 1, 2}), frozenset({3}))
    row = m.managers.tables[2].req_to_blocks["a"]
    assert {b: set(o) for b, o in m.hisparse.owners.items()} == {
        row[p]: {("a", p)} for p in (0, 1, 2)
    }
    m, _ = hs.take_residency_updates(m, ["a"])
    t, pressed = core.device_pool(
        mgr.tiers(m), lambda p: pool_ops.get_new_blocks(p, pool_ops.get_num_free_blocks(p))
    )
    m = mgr.with_tiers(m, t)
    assert m.hisparse is not None
    book = m.hisparse.books["a"]
    assert (book.lost, book.unpinned, book.stale) == (
        frozenset({0, 1, 2}),
        frozenset(),
        frozenset({0, 1, 2}),
    )
    assert m.hisparse.owners == {} and "a" in m.hisparse.hot_required
    assert tuple(core.resident_row(mgr.tiers(m), 2, "a")) == (0, 0, 0, row[3], row[4])
    m, answer = hs.all_context_pages_resident(m, [("a", 64, 1)])
    assert not answer
    check_hisparse(m, {"GPU": pressed})
    m, _ = mgr.free(m, "a", finished=True)
    # only the pressed blocks are still held: the lost pages' blocks were not freed again
    held = {b for b in range(1, 40) if m.managers.pool.blocks[b].ref_cnt}
    assert held == set(pressed) and set(row[:3]) <= held and not set(hot) & held
    check_hisparse(m, {"GPU": pressed})
