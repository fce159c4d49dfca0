"""Sparse retention: vLLM 0.33's ``prefix_cache_retention_interval`` on sliding-window groups.

The scenarios are vLLM 0.33.0's own (tests/v1/core/test_prefix_caching.py:
test_pure_swa_retention_interval_caches_sparse_tails, test_pure_swa_retention_latest_only,
test_hybrid_local_kv_retention_interval_aligns_in_manager,
test_hybrid_local_kv_retention_latest_only_reuses_replay_boundary,
test_hybrid_local_kv_retention_interval_rejects_invalid,
test_positive_retention_rejects_full_attention), told again on the model and on the
impl, which must agree call by call; then the machine draws retention intervals.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import manager as mm
from kvpool.model import single_type as single
from kvpool.model.errors import InvalidArgument, InvalidManagerConfig, InvalidTokenCount
from kvpool.model.request import Request, new_request
from kvpool.model.retention import (
    reachable_boundaries,
    replay_boundaries,
    sliding_window_retention_mask,
)
from kvpool.model.single_type import (
    KVCacheSpec,
    full_attention,
    mamba_reserving,
    sliding_window,
)
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.targets.impl.request import ImplManagerTarget
from kvpool.specs.teaching import request_scenarios


def tokens(num_blocks: int, block: int) -> list[int]:
    """``num_blocks`` blocks, each of one repeated token (as vLLM's tests build them)."""
    return [i for i in range(num_blocks) for _ in range(block)]


class Both:
    """The model and the impl built alike; every call runs on both and must agree."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        interval: int | None,
        num_blocks: int = 100,
        **kwargs: Any,
    ) -> None:
        self.model = mm.new_kv_cache_manager(
            num_blocks, specs, 8192, retention_interval=interval, **kwargs
        )
        self.impl = KVCacheManager(
            KVCacheConfig(num_blocks, tuple(specs), interval), 8192, **kwargs
        )
        self.hbs = self.model.managers.pool.config.hash_block_size

    def request(self, rid: str, token_ids: list[int]) -> Request:
        return new_request(rid, token_ids, self.hbs)

    def lookup(self, request: Request) -> tuple[tuple[tuple[int, ...], ...], int, int]:
        self.model, found = mm.get_computed_blocks_with_boundary(self.model, request)
        blocks, length, boundary = self.impl.get_computed_blocks(request)
        assert (tuple(tuple(g) for g in blocks.get_block_ids()), length, boundary) == found
        return found

    def allocate(self, request: Request, num_new: int | None = None) -> None:
        hit, length, _ = self.lookup(request)
        num_new = request.num_tokens - length if num_new is None else num_new
        self.model, new = mm.allocate_slots(self.model, request, num_new, length, hit)
        impl_hit = KVCacheManager.create_kv_cache_blocks(
            self.impl, tuple([self.impl.block_pool.blocks[b] for b in g] for g in hit)
        )
        answer = self.impl.allocate_slots(request, num_new, length, impl_hit)
        assert new is not None and answer is not None
        assert tuple(tuple(g) for g in answer.get_block_ids()) == new
        assert self.impl.snapshot() == self.model

    def free(self, request: Request) -> None:
        self.model, _ = mm.free(self.model, request.request_id)
        self.impl.free(request)
        assert self.impl.snapshot() == self.model

    def cached(self, request: Request, group: int) -> set[int]:
        """The hash blocks of the request cached in ``group`` (model and impl agree)."""
        found = set()
        for i, block_hash in enumerate(request.block_hashes):
            in_model = (block_hash, group) in self.model.managers.pool.cached
            in_impl = self.impl.block_pool.get_cached_block(block_hash, [group]) is not None
            assert in_model == in_impl
            if in_model:
                found.add(i)
        return found


PURE = [sliding_window(16, 16)]
HYBRID = [full_attention(32), sliding_window(8, 8)]


@pytest.mark.parametrize(
    ("interval", "kept"),
    [(64, {3, 7, 11, 14, 15}), (0, {14}), (None, set(range(16)))],
)
def test_a_window_keeps_the_segment_tails_and_the_replay_tail(
    interval: int | None, kept: set[int]
) -> None:
    """test_pure_swa_retention_*: 64 keeps every fourth block and the block before the replay
    boundary (255 tokens, rounded to 240); 0 only that one; None (dense) every block. A
    replay still hits 240 tokens."""
    both = Both(PURE, interval, hash_block_size=16)
    request = both.request("0", tokens(16, 16))
    both.allocate(request)
    assert both.cached(request, 0) == kept
    assert both.lookup(both.request("1", tokens(16, 16)))[1] == 240


@pytest.mark.parametrize(("interval", "kept"), [(64, {7, 11, 15}), (0, {11})])
def test_a_hybrid_window_keeps_the_tails_at_scheduler_boundaries(
    interval: int, kept: set[int]
) -> None:
    """test_hybrid_local_kv_retention_*: blocks of 8 beside full attention's 32: the replay
    boundary is 127 tokens, rounded to 96."""
    both = Both(HYBRID, interval, hash_block_size=8)
    request = both.request("0", tokens(16, 8))
    both.allocate(request)
    assert both.cached(request, 1) == kept
    both.free(request)
    hit, length, _ = both.lookup(both.request("1", tokens(16, 8)))
    assert (length, [len(g) for g in hit]) == (96, [3, 12])
    # a prompt ending at 96 tokens resumes at 95 (rounded to 64): latest-only kept no tail
    shorter = both.lookup(both.request("2", tokens(12, 8)))[1]
    assert shorter == (64 if interval else 0)


def test_chunks_cache_the_same_blocks_as_one_allocation() -> None:
    """The mask is taken over each chunk's new blocks; the replay tail arrives with the chunk
    that fills it."""
    both = Both(PURE, 0, hash_block_size=16)
    request = both.request("0", tokens(16, 16))
    both.allocate(request, 100)
    assert both.cached(request, 0) == set()
    request = replace(request, num_computed_tokens=100)
    both.model, _ = mm.allocate_slots(both.model, request, 156)
    both.impl.allocate_slots(request, 156)
    assert both.impl.snapshot() == both.model
    assert both.cached(request, 0) == {14}


def test_the_shared_prefix_boundary_keeps_its_window() -> None:
    """test_swa_shared_prefix_reuse_under_zero_retention: a request sharing a prefix with an
    earlier one caches the window ending at the junction the scheduler noted, so a third
    request reuses it; without the note the junction is not kept."""
    for pin, expected in ((True, 32), (False, 0)):
        both = Both([full_attention(16), sliding_window(16, 16)], 0, hash_block_size=16)
        shared = [7] * 32
        first = both.request("0", shared + [50] * 32)
        both.allocate(first)
        second = both.request("1", shared + [60] * 32)
        _, hit, boundary = both.lookup(second)
        assert (hit, boundary) == (0, 32)
        if pin:
            second = replace(second, shared_prefix_boundary=boundary)
        both.allocate(second, 32)
        third = both.request("2", shared + [70] * 32)
        assert both.lookup(third)[1] == expected


def test_eagle_keeps_the_block_past_the_boundary() -> None:
    """test_hybrid_local_kv_retention_mtp_reuses_latest_boundary (EAGLE on every group, as
    kvpool models it): 127 tokens, the replay boundary one scheduler block back at 64; the
    window's run plus the block past it: hashes 7 and 8."""
    both = Both(HYBRID, 0, hash_block_size=8, use_eagle=True)
    prompt = [i for i in range(15) for _ in range(8)] + [15] * 7
    request = both.request("0", prompt)
    both.allocate(request)
    assert both.cached(request, 1) == {7, 8}


def test_the_boundaries_and_the_mask() -> None:
    assert replay_boundaries(128, 32, True) == (64, 96)
    assert reachable_boundaries((255,), 0, 16, True) == (255,)
    assert reachable_boundaries((255,), 64, 16, False) == (255, 64)
    # a tail filling the segment keeps every block
    assert sliding_window_retention_mask(0, 8, 16, 16, 64, False, 64, ()) is None
    # EAGLE's runs end one block past each segment (and past the boundary)
    mask = sliding_window_retention_mask(0, 9, 16, 16, 16, True, 64, (0,))
    assert mask is not None
    assert [i for i, kept in enumerate(mask) if kept] == [0, 3, 4, 7, 8]


# --------------------------------------------------------------------------
# Rejections: vLLM 0.33's (ValueError) and kvpool's own
# --------------------------------------------------------------------------


def _both_refuse(specs: Sequence[KVCacheSpec], interval: object, words: str, **kw: Any) -> None:
    with pytest.raises(InvalidManagerConfig, match=words):
        mm.new_kv_cache_manager(100, specs, 8192, retention_interval=interval, **kw)  # type: ignore[arg-type]
    with pytest.raises(InvalidManagerConfig, match=words):
        KVCacheManager(KVCacheConfig(100, tuple(specs), interval), 8192, **kw)


@pytest.mark.parametrize(("interval", "words"), [(-32, "non-negative"), (33, "multiple of")])
def test_invalid_retention_interval_off_the_scheduler_block(interval: int, words: str) -> None:
    _both_refuse(HYBRID, interval, words, hash_block_size=8)
    assert issubclass(InvalidManagerConfig, ValueError)  # what vLLM's tests expect


def test_invalid_retention_interval_without_a_sparse_group() -> None:
    _both_refuse([full_attention(16)], 16, "no sliding-window or Mamba", hash_block_size=16)
    _both_refuse([full_attention(16)], -16, "no sliding-window or Mamba", hash_block_size=16)
    # 0 is ignored there, as vLLM ignores it
    mm.new_kv_cache_manager(10, [full_attention(16)], 8192, retention_interval=0)
    KVCacheManager(KVCacheConfig(10, (full_attention(16),), 0), 8192)


@pytest.mark.parametrize("interval", [16.0, True, "64"])
def test_invalid_retention_interval_that_is_no_int(interval: object) -> None:
    _both_refuse(PURE, interval, "must be None or an int", hash_block_size=16)


def test_invalid_retention_interval_beside_mamba_align_checkpoints() -> None:
    """Mamba "align" states thin under retention (tests/request/test_align_retention.py);
    prefill checkpoint blocks beside it are not modelled: refused by name."""
    spec = mamba_reserving(16, 0, 16)
    _both_refuse([spec], 0, "prefill checkpoints is not modelled", hash_block_size=16)
    _both_refuse([spec], 32, "prefill checkpoints is not modelled", hash_block_size=16)


def _started(interval: int = 0) -> Both:
    both = Both(PURE, interval, hash_block_size=16)
    both.allocate(both.request("0", tokens(4, 16)), 16)
    return both


def test_invalid_shared_prefix_boundary_negative() -> None:
    both = _started()
    request = replace(
        both.request("0", tokens(4, 16)), num_computed_tokens=16, shared_prefix_boundary=-16
    )
    before_model, before_impl = both.model, both.impl.snapshot()
    with pytest.raises(InvalidTokenCount):
        mm.allocate_slots(both.model, request, 16)
    with pytest.raises(InvalidTokenCount):
        mm.cache_blocks(both.model, request, 32)
    with pytest.raises(InvalidTokenCount):
        both.impl.allocate_slots(request, 16)
    with pytest.raises(InvalidTokenCount):
        both.impl.cache_blocks(request, 32)
    assert both.model == before_model
    assert both.impl.snapshot() == before_impl == before_model


def test_a_dense_manager_does_not_read_the_shared_prefix_boundary() -> None:
    """Under dense retention (None) nothing reads the boundary, so nothing checks it; any
    interval checks it, even where no group is sparse (0 beside full attention only)."""
    request = replace(new_request("0", tokens(4, 16), 16), shared_prefix_boundary=-16)
    dense = Both(PURE, None, hash_block_size=16)
    dense.allocate(request, 16)
    full_only = Both([full_attention(16)], 0, hash_block_size=16)
    with pytest.raises(InvalidTokenCount):
        mm.allocate_slots(full_only.model, request, 16)
    with pytest.raises(InvalidTokenCount):
        full_only.impl.allocate_slots(request, 16)
    assert full_only.impl.snapshot() == full_only.model


@pytest.mark.parametrize("value", [16.0, None, "16", True])
def test_invalid_shared_prefix_boundary_that_is_no_int(value: object) -> None:
    """The impl reads vLLM's request object, whatever it holds: a named error, nothing done."""
    both = _started()
    request = replace(both.request("0", tokens(4, 16)), num_computed_tokens=16)
    object.__setattr__(request, "shared_prefix_boundary", value)
    before = both.impl.snapshot()
    with pytest.raises(InvalidArgument):
        both.impl.allocate_slots(request, 16)
    with pytest.raises(InvalidArgument):
        both.impl.cache_blocks(request, 32)
    assert both.impl.snapshot() == before


def test_invalid_cache_blocks_retention_interval_negative() -> None:
    """The single-type function's own precondition (the manager checks the interval first)."""
    managers = _started().model.managers
    with pytest.raises(InvalidTokenCount):
        single.cache_blocks(
            managers, 0, new_request("0", tokens(4, 16), 16), 32, retention_interval=-16
        )


# --------------------------------------------------------------------------
# The machine: the impl in lock-step with the model, retention intervals drawn
# --------------------------------------------------------------------------


def _run(machine: type, max_examples: int) -> None:
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=max_examples,
        stateful_step_count=30,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )
    run_state_machine_as_test(machine, settings=chosen)


SPARSE_LAYOUTS = [
    "sliding_window",
    "full+sliding_window",
    "wide_full+sliding_window",
    "full+wide_sliding_window",
    "full+sliding_window+sliding_window",
]

MACHINES: dict[str, Callable[[], type]] = {
    "impl": lambda: manager_machine(
        ImplManagerTarget, layouts=SPARSE_LAYOUTS, retentions=(None, 0, 1, 2, 3)
    ),
    "impl-eagle-scheduler": lambda: manager_machine(
        ImplManagerTarget,
        layouts=SPARSE_LAYOUTS,
        retentions=(0, 1, 2),
        eagle_hybrids=True,
        prefill_lookaheads=(0, 1, 2),
        scheduler_calls=True,
        in_flight=(None, 3),
    ),
    # per-group EAGLE flags: replay boundaries are the manager's EAGLE, not the group's
    "impl-eagle-flags": lambda: manager_machine(
        ImplManagerTarget,
        layouts=SPARSE_LAYOUTS,
        retentions=(0, 1, 2),
        eagle_hybrids=True,
        eagle_flags=True,
    ),
    # the model as a target: the machine's own bookkeeping under sparse retention
    "model": lambda: manager_machine(
        ModelManagerTarget, layouts=SPARSE_LAYOUTS, retentions=(0, 1), level=2
    ),
}


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_impl_conforms_in_lock_step_under_sparse_retention(name: str) -> None:
    _run(MACHINES[name](), max_examples=60)


def test_invalid_cache_blocks_shared_prefix_boundary_negative() -> None:
    managers = _started().model.managers
    request = replace(new_request("0", tokens(4, 16), 16), shared_prefix_boundary=-1)
    with pytest.raises(InvalidTokenCount):
        single.cache_blocks(managers, 0, request, 16, retention_interval=0)
    # dense retention does not read it
    single.cache_blocks(managers, 0, request, 16)


def test_machine_programs_under_sparse_retention_replay_through_the_scenario_format() -> None:
    """The interval travels in the scenario's config and each lookup's boundary lands on the
    request, so a program replays to exactly the machine's state (``kvpool explain``)."""
    base = manager_machine(
        ModelManagerTarget, layouts=SPARSE_LAYOUTS, retentions=(0, 1, 2), scheduler_calls=True
    )

    class Checked(base):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            if self.model is not None:
                line = request_scenarios.record(self.setup, self.script, "machine/program")
                story = request_scenarios.decode(json.loads(line))
                world = request_scenarios.final_state(story)
                assert world.manager == self.model
                live = {r: q for r, q in world.requests.items() if not r.startswith("stranger-")}
                assert live == self.requests
            super().teardown()

    _run(Checked, max_examples=60)


def test_the_interval_round_trips_through_both_setup_codecs() -> None:
    from kvpool.specs.protocol import request_codec
    from kvpool.specs.request.target import ManagerSetup

    for interval in (None, 0, 32):
        setup = ManagerSetup(8, tuple(HYBRID), 64, 8, retention_interval=interval)
        assert request_codec.decode_setup(request_codec.encode_setup(setup)) == setup
        encoded = request_scenarios.encode_setup(setup)
        assert ("retention_interval" in encoded) == (interval is not None)
        assert request_scenarios.decode_setup(encoded) == setup


def test_replay_boundaries_follow_the_managers_eagle_not_the_groups_flag() -> None:
    """EAGLE flagged on the full-attention group only: the window group does not drop a
    block, yet its replay boundaries are EAGLE's (vLLM 0.33's coordinator passes
    ``use_eagle=bool(drop_eagle_group_ids)`` to every group's ``cache_blocks``). Found by
    the request protocol's ``eagle_flags`` and ``sparse_retention`` features over ``cmd:``."""
    specs = (full_attention(2), sliding_window(2, 1))
    model = mm.new_kv_cache_manager(
        9, specs, 16, hash_block_size=1, use_eagle=True, retention_interval=0, eagle_groups=[0]
    )
    impl_eagle = KVCacheManager(
        KVCacheConfig(9, specs, 0, eagle_groups=(0,)), 16, hash_block_size=1, use_eagle=True
    )
    request = new_request("r0", [1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1], 1)
    model, new = mm.allocate_slots(model, request, 8)
    answer = impl_eagle.allocate_slots(request, 8)
    assert new is not None and answer is not None
    assert tuple(tuple(g) for g in answer.get_block_ids()) == new
    # the window's block ending at token 8 (the resend's boundary, one block back) is kept
    assert (request.block_hashes[7], 1) in model.managers.pool.cached
    assert impl_eagle.snapshot() == model
