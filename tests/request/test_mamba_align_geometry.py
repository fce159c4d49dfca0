"""Mamba "align" beside larger blocks, and the connector's per-group lookup beside it.

The model (``kvpool.model.manager.verify_align_geometry``,
``kvpool.model.per_group_hit``) and the impl answer alike; the comparison with
vLLM 0.33 itself is in ``test_vllm_mamba_align.py``.
"""

from dataclasses import replace
from typing import Any

import pytest

import kvpool.model.manager as manager
import kvpool.model.scheduler_calls as calls
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.request import Request, new_request, with_computed
from kvpool.model.single_type import KVCacheSpec, full_attention, mamba_align, sliding_window
from kvpool.specs.request.target import ManagerSetup
from tests.request.align_programs import random_program

WIDE = (full_attention(8), mamba_align(4))
"""Full attention of 8-token blocks beside a Mamba block of one 4-token hash block."""

PROMPT = list(range(20))


def both(
    specs: tuple[KVCacheSpec, ...], num_blocks: int = 32, **kw: Any
) -> tuple[manager.KVCacheManagerState, KVCacheManager]:
    return (
        manager.new_kv_cache_manager(num_blocks, specs, 64, **kw),
        KVCacheManager(KVCacheConfig(num_blocks, specs), 64, **kw),
    )


def ids_of(blocks: Any) -> manager.Blocks:
    return tuple(tuple(g) for g in blocks.get_block_ids())


def run(
    kv: manager.KVCacheManagerState,
    impl: KVCacheManager,
    request: Request,
    chunks: list[tuple[int, int]],
) -> manager.KVCacheManagerState:
    """Allocate each (start, tokens) chunk of ``request`` in both, one step each."""
    for start, num_new in chunks:
        r = with_computed(request, start)
        kv, ids = manager.allocate_slots(kv, r, num_new)
        assert ids_of(impl.allocate_slots(r, num_new)) == ids
        kv, _ = manager.new_step_starts(kv)
        impl.new_step_starts()
    return kv


def evict(
    kv: manager.KVCacheManagerState, impl: KVCacheManager, ids: set[int]
) -> manager.KVCacheManagerState:
    kv, _ = manager.evict_blocks(kv, ids)
    impl.evict_blocks(ids)
    return kv


# --------------------------------------------------------------------------
# A Mamba block of one hash block beside larger blocks
# --------------------------------------------------------------------------


def test_the_scheduler_block_is_the_larger_block_and_hits_end_on_it() -> None:
    kv, impl = both(WIDE)
    assert kv.config.scheduler_block_size == impl.scheduler_block_size == 8
    kv = run(kv, impl, new_request("a", PROMPT, 4), [(0, 8), (8, 8)])
    b = new_request("b", [*PROMPT[:17], 99], 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    assert (hit, num_hit) == (((1, 3), (0, 0, 0, 4)), 16)
    blocks, count, _ = impl.get_computed_blocks(b)
    assert (ids_of(blocks), count) == (hit, 16)
    assert impl.snapshot() == kv


def test_a_state_off_the_scheduler_block_is_no_hit() -> None:
    """The state after 12 tokens is cached, the one after 16 evicted: a hit could end at 12
    on Mamba's blocks, but not on full attention's, so there is none."""
    kv, impl = both(WIDE)
    kv = run(kv, impl, new_request("a", PROMPT, 4), [(0, 12), (12, 4)])
    state_at_16 = kv.managers.tables[1].req_to_blocks["a"][3]
    kv, _ = manager.free(kv, "a")
    impl.free(new_request("a", PROMPT, 4))
    kv = evict(kv, impl, {state_at_16})
    b = new_request("b", [*PROMPT[:17], 99], 4)
    assert manager.get_computed_blocks(kv, b)[1] == (((), ()), 0)
    assert impl.get_computed_blocks(b)[1] == 0


def test_a_sliding_window_beside_a_small_mamba_block() -> None:
    kv, impl = both((sliding_window(8, 5), mamba_align(4)))
    kv = run(kv, impl, new_request("a", PROMPT, 4), [(0, 8), (8, 8), (16, 4)])
    b = new_request("b", [*PROMPT[:17], 99], 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    assert num_hit == 16 and hit[1] == (0, 0, 0, 4)
    assert ids_of(impl.get_computed_blocks(b)[0]) == hit


def test_invalid_align_block_of_several_hash_blocks_beside_a_window() -> None:
    """Hits inside a Mamba block (vLLM's fine-grained hits) are modelled beside full attention
    only (kvpool.model.mamba_fine_config; tests/request/test_mamba_fine.py)."""
    specs = (sliding_window(8, 8), mamba_align(16))
    with pytest.raises(InvalidManagerConfig, match="hits inside a block beside a sliding_window"):
        manager.new_kv_cache_manager(16, specs, 64, hash_block_size=4)
    with pytest.raises(InvalidManagerConfig, match="hits inside a block beside a sliding_window"):
        KVCacheManager(KVCacheConfig(16, specs), 64, hash_block_size=4)


def test_invalid_align_block_beside_other_sizes_without_caching_of_another_size() -> None:
    specs = (full_attention(4), mamba_align(8))
    for build in (
        lambda: manager.new_kv_cache_manager(16, specs, 64, enable_caching=False),
        lambda: KVCacheManager(KVCacheConfig(16, specs), 64, enable_caching=False),
    ):
        with pytest.raises(InvalidManagerConfig, match="beside blocks of sizes"):
            build()


def test_invalid_align_beside_other_sizes_with_decode_context_parallelism() -> None:
    """With decode context parallelism and caching on vLLM turns fine-grained hits on (hits
    on hash blocks: kvpool.model.align_dcp, tests/request/test_align_dcp.py); with caching
    off the geometry stays refused."""
    specs = (full_attention(4), mamba_align(4))
    with pytest.raises(InvalidManagerConfig, match="dcp_world_size=1 \\(got 2\\)"):
        manager.new_kv_cache_manager(16, specs, 64, enable_caching=False, dcp_world_size=2)
    with pytest.raises(InvalidManagerConfig, match="dcp_world_size=1 \\(got 2\\)"):
        KVCacheManager(KVCacheConfig(16, specs), 64, enable_caching=False, dcp_world_size=2)


def test_invalid_scheduler_block_larger_than_blocks_of_several_hash_blocks() -> None:
    specs = (full_attention(4), mamba_align(4))
    with pytest.raises(InvalidManagerConfig, match="beside blocks of sizes"):
        manager.new_kv_cache_manager(
            16, specs, 64, hash_block_size=2, enable_caching=False, scheduler_block_size=8
        )
    with pytest.raises(InvalidManagerConfig, match="beside blocks of sizes"):
        KVCacheManager(
            KVCacheConfig(16, specs),
            64,
            hash_block_size=2,
            enable_caching=False,
            scheduler_block_size=8,
        )


# --------------------------------------------------------------------------
# The connector's per-group lookup (hit_diverged)
# --------------------------------------------------------------------------

SAME = (full_attention(4), mamba_align(4))


def connector_lookup(
    kv: manager.KVCacheManagerState, impl: KVCacheManager, request: Request
) -> tuple[manager.KVCacheManagerState, tuple[manager.Blocks, int, int, bool]]:
    kv, answer = calls.get_computed_blocks_for_connector(kv, request)
    blocks, count, boundary, diverged = impl.get_computed_blocks_for_connector(request)
    assert (ids_of(blocks), count, boundary, diverged) == answer
    return kv, answer


def lagging_mamba() -> tuple[manager.KVCacheManagerState, KVCacheManager]:
    """Full attention holds 8 tokens of a prefix; Mamba's state after 8 was evicted, the one
    after 4 kept."""
    kv, impl = both(SAME, log_stats=True)
    kv = run(kv, impl, new_request("a", PROMPT[:10], 4), [(0, 4), (4, 4)])
    state_at_8 = kv.managers.tables[1].req_to_blocks["a"][1]
    kv, _ = manager.free(kv, "a")
    impl.free(new_request("a", PROMPT[:10], 4))
    return evict(kv, impl, {state_at_8}), impl


def test_a_lagging_mamba_group_flags_the_full_attention_hit_diverged() -> None:
    kv, impl = lagging_mamba()
    b = new_request("b", [*PROMPT[:9], 99], 4)
    kv, answer = connector_lookup(kv, impl, b)
    assert answer == (((1, 3), (2,)), 8, 0, True)
    # the plain lookup reconciles at the boundary both groups agree on
    assert manager.get_computed_blocks(kv, b)[1] == (((1,), (2,)), 4)
    assert kv.stats is not None and kv.stats.hits == 8
    assert impl.snapshot() == kv


def test_a_group_deeper_than_full_attention_gets_the_plain_lookup() -> None:
    kv, impl = both(SAME)
    kv = run(kv, impl, new_request("a", PROMPT[:10], 4), [(0, 4), (4, 4)])
    full_block_2 = kv.managers.tables[0].req_to_blocks["a"][1]
    kv, _ = manager.free(kv, "a")
    impl.free(new_request("a", PROMPT[:10], 4))
    kv = evict(kv, impl, {full_block_2})
    b = new_request("b", [*PROMPT[:9], 99], 4)
    kv, answer = connector_lookup(kv, impl, b)
    assert answer == (((1,), (2,)), 4, 0, False)


def test_agreeing_groups_answer_the_plain_lookup_not_diverged() -> None:
    kv, impl = both(SAME)
    kv = run(kv, impl, new_request("a", PROMPT[:10], 4), [(0, 4), (4, 4)])
    b = new_request("b", [*PROMPT[:9], 99], 4)
    plain = manager.get_computed_blocks(kv, b)[1]
    kv, answer = connector_lookup(kv, impl, b)
    assert answer == (*plain, 0, False) and plain[1] == 8


def test_a_request_skipping_the_cache_gets_nothing_per_group() -> None:
    kv, impl = lagging_mamba()
    b = replace(new_request("b", [*PROMPT[:9], 99], 4), skip_reading_prefix_cache=True)
    before = kv
    kv, answer = connector_lookup(kv, impl, b)
    assert answer == (((), ()), 0, 0, False) and kv == before


# --------------------------------------------------------------------------
# The scheduler's other calls with an "align" group
# --------------------------------------------------------------------------


def test_pop_blocks_for_free_forgets_only_that_requests_states() -> None:
    kv, impl = both(SAME)
    a, c = new_request("a", PROMPT[:10], 4), new_request("c", [7] * 10, 4)
    kv = run(kv, impl, a, [(0, 4)])
    kv = run(kv, impl, c, [(0, 4), (4, 4)])
    kv, popped = calls.pop_blocks_for_free(kv, "a")
    assert [b.block_id for b in impl.pop_blocks_for_free(a)] == list(popped)
    align = kv.managers.tables[1].align
    assert "a" not in align.allocated and "c" in align.allocated
    assert align.last_state == {"c": 0}
    assert impl.snapshot() == kv


def test_whole_sequence_admission_counts_one_state_block() -> None:
    """A 10-token request with 3 free blocks: full attention needs 3 blocks for its whole
    sequence, Mamba one state block (vLLM 0.33 counts a chunk's), so it does not fit; with 4
    it does."""
    for num_blocks, fits in ((4, False), (5, True)):  # the null block is one of them
        kv, impl = both(SAME, num_blocks=num_blocks)
        r = new_request("a", PROMPT[:10], 4)
        kv, got = manager.allocate_slots(kv, r, 4, full_sequence_must_fit=True)
        answer = impl.allocate_slots(r, 4, full_sequence_must_fit=True)
        assert (got is not None) == fits == (answer is not None)


def test_random_runs_beside_larger_blocks_match_between_model_and_impl() -> None:
    """The seeded runs of ``align_programs`` on the model and the impl (vLLM joins them in
    ``test_vllm_mamba_align.py``)."""
    from kvpool.specs.request.model_target import ModelManagerTarget
    from kvpool.specs.targets.impl.request import ImplManagerTarget

    def targets(setup: ManagerSetup) -> list[Any]:
        return [ModelManagerTarget(setup), ImplManagerTarget(setup)]

    seen = {"diverged": 0, "hits": 0}
    for seed in range(40):
        for key, count in random_program(seed, targets).items():
            seen[key] += count
    assert seen["diverged"] >= 50 and seen["hits"] >= 150, seen


def test_invalid_connector_lookup_of_a_request_hashed_in_other_blocks() -> None:
    """The per-group lookup checks the request's hash block size first, as the plain one
    does: a named error, nothing changed."""
    from kvpool.model.errors import PoolError

    kv, impl = lagging_mamba()
    wrong = new_request("b", [*PROMPT[:9], 99], 2)
    before, impl_before = kv, impl.snapshot()
    with pytest.raises(PoolError) as model_error:
        calls.get_computed_blocks_for_connector(kv, wrong)
    with pytest.raises(PoolError) as impl_error:
        impl.get_computed_blocks_for_connector(wrong)
    assert type(model_error.value) is type(impl_error.value)
    assert kv == before and impl.snapshot() == impl_before
