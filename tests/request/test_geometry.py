"""Block geometry: groups of different block sizes, and decode/prefill context parallelism.

The scenarios are vLLM 0.33.0's own (tests/v1/core/test_prefix_caching.py:
test_different_block_size, test_hybrid_cache_blocks_clamped_to_lcm,
test_hybrid_cache_blocks_swa_tail_window_only; test_kv_cache_utils.py:
test_effective_attention_block_size_matches_events), told again on the model
and on the impl, which must agree call by call.
"""

from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import manager as mm
from kvpool.model.alignment import aligned_length, sliding_window_cache_mask
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.events import BlockStored
from kvpool.model.request import Request, new_request
from kvpool.model.single_type import (
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    mamba_align,
    sliding_window,
)
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.targets.impl.request import ImplManagerTarget

BLOCK = 4
FULL_WIDE = full_attention(2 * BLOCK)
WINDOW = sliding_window(BLOCK, 2 * BLOCK)


def tokens(num_blocks: int, block: int = BLOCK) -> list[int]:
    """``num_blocks`` hash blocks, each of one repeated token (as vLLM's tests build them)."""
    return [i + 1 for i in range(num_blocks) for _ in range(block)]


class Both:
    """The model and the impl built alike; every call runs on both and must agree."""

    def __init__(self, specs: Sequence[KVCacheSpec], num_blocks: int = 40, **kwargs: Any):
        self.model = mm.new_kv_cache_manager(num_blocks, specs, 64, **kwargs)
        self.impl = KVCacheManager(KVCacheConfig(num_blocks, tuple(specs)), 64, **kwargs)
        self.hbs = self.model.managers.pool.config.hash_block_size

    def request(self, rid: str, token_ids: list[int]) -> Request:
        return new_request(rid, token_ids, self.hbs)

    def lookup(self, request: Request) -> tuple[tuple[tuple[int, ...], ...], int]:
        self.model, (hit, length, boundary) = mm.get_computed_blocks_with_boundary(
            self.model, request
        )
        blocks, impl_length, impl_boundary = self.impl.get_computed_blocks(request)
        assert tuple(tuple(g) for g in blocks.get_block_ids()) == hit
        assert (impl_length, impl_boundary) == (length, boundary)
        return hit, length

    def allocate(self, request: Request, num_new: int) -> tuple[tuple[int, ...], ...]:
        hit, length = self.lookup(request)
        self.model, new = mm.allocate_slots(self.model, request, num_new, length, hit)
        impl_hit = KVCacheManager.create_kv_cache_blocks(
            self.impl,
            tuple(
                [self.impl.block_pool.blocks[b] for b in group]
                for group in hit  # the impl's blocks of the same ids
            ),
        )
        answer = self.impl.allocate_slots(request, num_new, length, impl_hit)
        assert new is not None and answer is not None
        assert tuple(tuple(g) for g in answer.get_block_ids()) == new
        assert self.impl.snapshot() == self.model
        return new

    def cached(self, request: Request, index: int, group: int) -> bool:
        """Whether hash block ``index`` of the request is cached in ``group`` (model and impl)."""
        key = (request.block_hashes[index], group)
        in_model = key in self.model.managers.pool.cached
        in_impl = self.impl.block_pool.get_cached_block(request.block_hashes[index], [group])
        assert in_model == (in_impl is not None)
        return in_model


def test_hits_of_two_block_sizes_land_on_multiples_of_both() -> None:
    """test_different_block_size: full attention of 8-token blocks, a window of 4-token blocks."""
    both = Both([FULL_WIDE, WINDOW], hash_block_size=BLOCK)
    common = tokens(10)
    assert both.allocate(both.request("0", common), 7 * BLOCK) == (
        (1, 2, 3, 4),
        tuple(range(5, 12)),
    )
    hit, length = both.lookup(both.request("1", common[: 7 * BLOCK + 1]))
    assert (len(hit[0]), len(hit[1]), length) == (3, 6, 6 * BLOCK)
    hit, length = both.lookup(both.request("2", common[: 6 * BLOCK + 1]))
    assert (len(hit[0]), len(hit[1]), length) == (3, 6, 6 * BLOCK)


def test_a_window_hit_that_is_not_a_multiple_of_the_wide_block_is_cut_back() -> None:
    """The window's run ending at 5 blocks is not a whole number of full attention's blocks:
    the hit is 4 blocks (test_different_block_size's last step, by eviction)."""
    both = Both([FULL_WIDE, WINDOW], hash_block_size=BLOCK)
    common = tokens(10)
    both.allocate(both.request("0", common), 7 * BLOCK)
    one = both.request("1", common[: 7 * BLOCK + 1])
    blocks = dict(zip(range(7), both.model.managers.tables[1].req_to_blocks["0"], strict=False))
    both.model, _ = mm.evict_blocks(both.model, {blocks[5], blocks[6]})
    both.impl.evict_blocks({blocks[5], blocks[6]})
    hit, length = both.lookup(one)
    assert (len(hit[0]), length) == (2, 4 * BLOCK)


def test_caching_stops_at_the_last_multiple_of_the_scheduler_block() -> None:
    """test_hybrid_cache_blocks_clamped_to_lcm: 7 hash blocks, lcm 8 tokens: 6 are cached."""
    both = Both([FULL_WIDE, WINDOW], hash_block_size=BLOCK)
    request = both.request("0", tokens(7))
    both.allocate(request, 7 * BLOCK)
    assert [both.cached(request, i, 1) for i in range(7)] == [True] * 6 + [False]


def test_a_window_caches_only_the_blocks_ending_each_segment() -> None:
    """test_hybrid_cache_blocks_swa_tail_window_only: blocks 4 times the window's: only the
    last window block of each 4-block segment can serve a hit, so only it is cached."""
    both = Both([full_attention(4 * BLOCK), sliding_window(BLOCK, BLOCK)], hash_block_size=BLOCK)
    request = both.request("0", tokens(8))
    both.allocate(request, 8 * BLOCK)
    assert {i for i in range(8) if both.cached(request, i, 1)} == {3, 7}


def test_the_cache_mask_keeps_the_run_before_each_boundary() -> None:
    assert sliding_window_cache_mask(0, 8, 32, 8, 8, False) == (False, False, False, True) * 2
    # a window of two blocks keeps the two before each boundary
    assert sliding_window_cache_mask(0, 4, 32, 8, 10, False) == (False, False, True, True)
    # EAGLE's extra block is the one after the boundary
    assert sliding_window_cache_mask(0, 5, 32, 8, 8, True) == (False, False, False, True, True)
    assert sliding_window_cache_mask(2, 4, 8, 8, 8, False) is None
    assert aligned_length(47, 16) == 32


def test_decode_context_parallelism_multiplies_a_sharded_block() -> None:
    """test_effective_attention_block_size_matches_events[4]: the stored event's block size
    is the sharded block's, 16 tokens per rank on 4 ranks."""
    for dcp in (1, 4):
        both = Both([full_attention(16)], 32, hash_block_size=16 * dcp, dcp_world_size=dcp)
        both.model = mm.new_kv_cache_manager(
            32, [full_attention(16)], 256, 16 * dcp, enable_events=True, dcp_world_size=dcp
        )
        both.impl = KVCacheManager(
            KVCacheConfig(32, (full_attention(16),)),
            256,
            hash_block_size=16 * dcp,
            enable_kv_cache_events=True,
            dcp_world_size=dcp,
        )
        both.allocate(both.request("r", list(range(64))), 64)
        both.model, events = mm.take_events(both.model)
        assert [e.block_size for e in events if isinstance(e, BlockStored)] == [16 * dcp]
        stored = cast(Sequence[BlockStored], both.impl.take_events())  # events of one allocation
        assert [e.block_size for e in stored] == [16 * dcp]
        assert [m.block_size for m in both.impl.managers] == [16 * dcp]


def test_an_unsharded_group_keeps_its_block_size() -> None:
    replicated = KVCacheSpec(full_attention(4).attention, 4, dcp_sharded=False)
    both = Both([full_attention(4), replicated, mamba(64)], hash_block_size=4, dcp_world_size=2)
    assert [s.block_size for s in both.model.managers.specs] == [8, 4, 64]
    assert [(m.dcp_world_size, m.block_size) for m in both.impl.managers] == [
        (2, 8),
        (1, 4),
        (1, 64),
    ]
    assert both.model.config.scheduler_block_size == 64


def test_blocks_for_computed_tokens_count_the_spec_block_under_decode_parallelism() -> None:
    """vLLM 0.33.0's get_block_ids_for_computed_tokens cuts by kv_cache_spec.block_size (4),
    not the manager's sharded block (8): 6 tokens keep 2 blocks of the request's 3."""
    from kvpool.model import scheduler_calls

    both = Both([full_attention(BLOCK)], dcp_world_size=2, hash_block_size=2 * BLOCK)
    request = both.request("0", tokens(5))
    new = both.allocate(request, 5 * BLOCK - 1)
    assert len(new[0]) == 3
    model = scheduler_calls.get_block_ids_for_computed_tokens(both.model, "0", 6)
    impl = both.impl.get_block_ids_for_computed_tokens("0", 6)
    assert model == tuple(tuple(g) for g in impl) == (new[0][:2],)


def test_prefill_context_parallelism_changes_no_block() -> None:
    both = Both([full_attention(4), full_attention(4)], pcp_world_size=2)
    request = both.request("r", tokens(3))
    both.allocate(request, 3 * BLOCK)
    assert both.model.managers.specs[0].block_size == 4


# --------------------------------------------------------------------------
# Configurations vLLM 0.33 refuses (it asserts; kvpool names the error)
# --------------------------------------------------------------------------


def _rejected_by_both(specs: Sequence[KVCacheSpec], **kwargs: Any) -> None:
    with pytest.raises(InvalidManagerConfig):
        mm.new_kv_cache_manager(8, specs, 64, **kwargs)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(KVCacheConfig(8, tuple(specs)), 64, **kwargs)


def test_invalid_scheduler_block_size_not_a_multiple() -> None:
    _rejected_by_both([full_attention(8), sliding_window(4, 4)], scheduler_block_size=12)


def test_invalid_scheduler_block_size_not_a_multiple_of_the_hash_block() -> None:
    _rejected_by_both([full_attention(8)], hash_block_size=8, scheduler_block_size=4)


def test_invalid_scheduler_block_size_not_an_int() -> None:
    _rejected_by_both([full_attention(8)], scheduler_block_size=8.0)


def test_invalid_chunked_local_beside_wider_blocks() -> None:
    """vLLM 0.33's chunked-local search asserts its block size is the hit alignment."""
    _rejected_by_both([full_attention(8), chunked_local(4, 8)], hash_block_size=4)


def test_invalid_dcp_on_a_sharded_sliding_window() -> None:
    _rejected_by_both([full_attention(4), sliding_window(4, 4)], dcp_world_size=2)


def test_invalid_dcp_on_chunked_local_attention() -> None:
    _rejected_by_both([chunked_local(4, 8)], dcp_world_size=2)


def test_invalid_pcp_beside_mamba() -> None:
    _rejected_by_both([full_attention(4), mamba(64)], pcp_world_size=2)


def test_invalid_pcp_on_a_sharded_sliding_window() -> None:
    _rejected_by_both([sliding_window(4, 4)], pcp_world_size=2)


def test_invalid_mamba_align_beside_another_block_size() -> None:
    """Mamba "align" of several hash blocks (hits inside a Mamba block) beside anything but
    full attention (kvpool.model.mamba_fine_config), or any size mix with decode context
    parallelism: not modelled, refused by name."""
    _rejected_by_both([sliding_window(8, 4), mamba_align(16)], hash_block_size=4)
    _rejected_by_both([sliding_window(4, 4), mamba_align(8)], hash_block_size=4)
    # with caching off there are no hits, and the geometry checks of one hash block apply
    _rejected_by_both([full_attention(4), mamba_align(8)], hash_block_size=4, enable_caching=False)
    # decode context parallelism widens the attention group but not the (replicated) Mamba:
    # modelled with caching on (kvpool.model.align_dcp), refused with caching off
    _rejected_by_both([full_attention(4), mamba_align(4)], dcp_world_size=2, enable_caching=False)


def test_invalid_mamba_align_of_several_hash_blocks_with_a_wider_scheduler_block() -> None:
    _rejected_by_both(
        [full_attention(4), mamba_align(4)],
        hash_block_size=2,
        enable_caching=False,
        scheduler_block_size=8,
    )


def test_mamba_align_of_several_hash_blocks_beside_full_attention_of_one_is_accepted() -> None:
    """kvpool.model.mamba_fine: hits may end inside the Mamba block (vLLM 0.33.0 turns
    partial hash hits on there)."""
    Both([full_attention(4), mamba_align(8)], hash_block_size=4)
    Both([full_attention(4), mamba_align(12)], hash_block_size=4, scheduler_block_size=12)
    Both([full_attention(8), mamba_align(12)], hash_block_size=4)


def test_mamba_align_of_one_hash_block_beside_larger_blocks_is_accepted() -> None:
    """kvpool.model.manager.verify_align_geometry: vLLM keeps fine-grained hits off there."""
    Both([full_attention(4), mamba_align(4)], scheduler_block_size=4)
    Both([full_attention(4), mamba_align(4)], scheduler_block_size=8)
    Both([full_attention(8), mamba_align(4)], hash_block_size=4)


def test_the_eagle_look_ahead_is_bounded_by_the_scheduler_block_not_the_smallest_block() -> None:
    """vLLM 0.33.0 compares num_prefill_lookahead with scheduler_block_size
    (KVCacheCoordinator.__init__): 8 tokens here, where the window's block is 4."""
    specs = [FULL_WIDE, WINDOW]
    Both(specs, hash_block_size=BLOCK, use_eagle=True, num_prefill_lookahead=2 * BLOCK)
    _rejected_by_both(
        specs, hash_block_size=BLOCK, use_eagle=True, num_prefill_lookahead=2 * BLOCK + 1
    )


def test_an_eagle_group_of_small_blocks_caches_the_block_past_each_boundary() -> None:
    """get_num_cacheable_tokens in 0.33.0: 7 hash blocks computed, the scheduler block is 8
    tokens; without EAGLE the window caches 6 blocks (3 scheduler blocks), with EAGLE one of
    its own blocks more (the one its peek matches); full attention's block is 8 tokens, so
    its count (one block past 24 is 32, beyond the 28 computed) stays 3."""
    for eagle, window_blocks in ((False, 6), (True, 7)):
        both = Both(
            [FULL_WIDE, sliding_window(BLOCK, 5 * BLOCK)], hash_block_size=BLOCK, use_eagle=eagle
        )
        request = both.request("0", tokens(7))
        both.allocate(request, 7 * BLOCK)
        assert both.model.managers.tables[1].num_cached_block["0"] == window_blocks
        assert both.model.managers.tables[0].num_cached_block["0"] == 3


@pytest.mark.parametrize("size", [0, -1, True, 1.5])
def test_invalid_world_size(size: object) -> None:
    _rejected_by_both([full_attention(4)], dcp_world_size=size)
    _rejected_by_both([full_attention(4)], pcp_world_size=size)


def test_a_replicated_window_runs_beside_decode_context_parallelism() -> None:
    replicated = KVCacheSpec(sliding_window(4, 4).attention, 4, 4, dcp_sharded=False)
    both = Both([full_attention(4), replicated], hash_block_size=4, dcp_world_size=2)
    request = both.request("r", tokens(4))
    both.allocate(request, 4 * BLOCK)
    assert both.model.config.scheduler_block_size == 8


# --------------------------------------------------------------------------
# The machine: the impl in lock-step with the model on the geometry it draws
# --------------------------------------------------------------------------


def _run(machine: type, max_examples: int) -> None:
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=max_examples,
        stateful_step_count=30,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )
    run_state_machine_as_test(machine, settings=chosen)


MACHINES: dict[str, Callable[[], type]] = {
    "two-block-sizes": lambda: manager_machine(
        ImplManagerTarget, layouts=["wide_full+sliding_window", "full+wide_sliding_window"]
    ),
    "context-parallel": lambda: manager_machine(
        ImplManagerTarget,
        layouts=["full", "full+full", "full+sliding_window"],
        context_parallel=((1, 1), (2, 1), (1, 2), (2, 2)),
    ),
    # the other branches' features on the geometry: EAGLE on hybrids, multi-module MTP's
    # look-ahead, every scheduler call and the in-flight cap
    "two-block-sizes-eagle-scheduler": lambda: manager_machine(
        ImplManagerTarget,
        layouts=["wide_full+sliding_window", "full+wide_sliding_window"],
        eagle_hybrids=True,
        prefill_lookaheads=(0, 1, 2, 3, 8),
        scheduler_calls=True,
        in_flight=(None, 3),
    ),
    "context-parallel-eagle-scheduler": lambda: manager_machine(
        ImplManagerTarget,
        layouts=["full", "full+full", "full+sliding_window"],
        context_parallel=((1, 1), (2, 1), (1, 2), (2, 2)),
        eagle_hybrids=True,
        prefill_lookaheads=(0, 1, 2, 3),
        scheduler_calls=True,
        in_flight=(None, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_impl_conforms_in_lock_step_on_the_geometry(name: str) -> None:
    _run(MACHINES[name](), max_examples=60)


class _RetainingConfig:
    """A vLLM-like config asking for sparse prefix-cache retention."""

    def __init__(self, specs: tuple[KVCacheSpec, ...], interval: int | None) -> None:
        self.num_blocks = 8
        self.kv_cache_groups = specs
        self.prefix_cache_retention_interval = interval


def test_invalid_retention_interval_is_refused_not_ignored() -> None:
    """Sparse retention is modelled (tests/request/test_retention.py); an interval off the
    scheduler block (8 tokens here), or where no group is sparse, is refused."""
    specs = (FULL_WIDE, WINDOW)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(_RetainingConfig(specs, 4), 64, hash_block_size=BLOCK)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(_RetainingConfig((full_attention(4),), 8), 64)
    assert KVCacheManager(_RetainingConfig(specs, 8), 64, hash_block_size=BLOCK).snapshot() == (
        mm.new_kv_cache_manager(8, specs, 64, hash_block_size=BLOCK, retention_interval=8)
    )
    KVCacheManager(_RetainingConfig(specs, 0), 64, hash_block_size=BLOCK)
    # vLLM ignores 0 where no group is sparse, and None is dense
    KVCacheManager(_RetainingConfig((full_attention(4),), 0), 64)
    KVCacheManager(_RetainingConfig(specs, None), 64, hash_block_size=BLOCK)
