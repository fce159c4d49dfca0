"""Prefill checkpoints where hits may end inside a Mamba block (kvpool.model.mamba_fine_reserve).

A Mamba "align" block of three hash blocks (12 tokens, hash blocks of 4) beside full
attention of one hash block, its checkpoints one hash block apart: a chunk spanning two
blocks or more exports the state at the last hash-block boundary before its end into the
block before the one it ends in. Model and impl in lock step, call by call and under the
request machine; vLLM 0.33 under the machine (optional: skips visibly without it).
"""

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvpool.model.mamba_reserve as reserve
import kvpool.model.manager as manager
import kvpool.model.single_type as single
from kvpool.impl.mamba_fine_reserve import MambaFineReservingManager
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.impl.single_type import num_prompt_tokens
from kvpool.model.errors import InvalidManagerConfig, UnknownGroup
from kvpool.model.pool import new_pool
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, mamba_reserving
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import MAMBA_FINE_LAYOUTS, ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget

SPECS = (full_attention(4), mamba_reserving(12, 0, 4))
"""Hash blocks of 4 tokens, Mamba blocks of 3 of them, checkpoints 4 tokens apart."""


def _pair() -> tuple[Any, KVCacheManager]:
    return (
        manager.new_kv_cache_manager(32, SPECS, 64, hash_block_size=4),
        KVCacheManager(KVCacheConfig(32, SPECS), 64, hash_block_size=4),
    )


# --------------------------------------------------------------------------
# What stays refused, by name
# --------------------------------------------------------------------------


def test_invalid_copying_allocation_in_a_group_not_align() -> None:
    pool = new_pool(16, hash_block_size=4)
    m = single.new_managers(pool, [full_attention(4), mamba_reserving(12, 1, 4)])
    m, _ = single.save_new_computed_blocks(m, 0, "r", [])
    before = m
    with pytest.raises(UnknownGroup, match='not a Mamba "align" group'):
        single.allocate_mamba_copy(m, 0, "r", 4, None)
    assert m == before


def test_checkpoints_with_hash_look_ahead_are_accepted_here_only() -> None:
    """Hits inside a Mamba block model a look-ahead of 2 (the checkpoint moves back); blocks
    of one hash block still refuse it by name."""
    impl = KVCacheManager(
        KVCacheConfig(16, SPECS), 64, hash_block_size=4, num_hash_lookahead_tokens=2
    )
    assert isinstance(impl.managers[1], MambaFineReservingManager)
    one = (full_attention(4), mamba_reserving(4, 0, 4))
    with pytest.raises(InvalidManagerConfig, match="num_hash_lookahead_tokens=2"):
        KVCacheManager(KVCacheConfig(16, one), 64, hash_block_size=4, num_hash_lookahead_tokens=2)


# --------------------------------------------------------------------------
# The semantics, call by call
# --------------------------------------------------------------------------


def test_the_checkpoint_leaves_the_look_ahead_after_it() -> None:
    """vLLM 0.33.0's get_mamba_prefill_checkpoint_position (the rows of its own test)."""
    for lookahead, prompt, boundary in (
        (0, 1089, 1088),
        (1, 1089, 1088),
        (2, 1089, 1024),
        (2, 1090, 1088),
        (3, 1089, 1024),
        (3, 1091, 1088),
    ):
        assert reserve.checkpoint_position(prompt, 64, lookahead) == boundary


def test_the_prompts_checkpoint_is_keyed_inside_the_block_then_hit() -> None:
    """29 tokens: the checkpoint at 28 (inside Mamba block 2) lives in block 1's column,
    keyed at 28 only; a resend resumes there."""
    kv, impl = _pair()
    a = new_request("a", list(range(29)), 4)
    kv, new = manager.allocate_slots(kv, a, 29)
    assert new is not None
    assert impl.allocate_slots(a, 29) is not None
    assert impl.snapshot() == kv
    table = kv.managers.tables[1]
    assert dict(table.align.checkpoints) == {"a": (28, 1)}
    block = table.req_to_blocks["a"][1]
    assert kv.managers.pool.blocks[block].hash_num_tokens == 28
    assert [k for k, _ in kv.managers.pool.blocks[block].hash_keys()] == [a.block_hashes[6]]
    kv, _ = manager.free(kv, "a")
    impl.free(with_computed(a, 29))
    assert impl.snapshot() == kv
    b = new_request("b", list(range(29)), 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    assert num_hit == 28 and hit[1] == (0, 0, block)
    impl_hit, impl_num, _ = impl.get_computed_blocks(b)
    assert impl_num == 28 and [x.block_id for x in impl_hit.blocks[1]] == list(hit[1])


def test_a_middle_chunks_checkpoint_is_transient() -> None:
    """A chunk of 36 of 60 tokens: its checkpoint at 32 is neither the prompt's nor on a block
    boundary, so block 1 (keyed at 24 as a full block this very call) loses its keys."""
    kv, impl = _pair()
    a = new_request("a", list(range(60)), 4)
    kv, _ = manager.allocate_slots(kv, a, 36)
    impl.allocate_slots(a, 36)
    assert impl.snapshot() == kv
    table = kv.managers.tables[1]
    assert dict(table.align.checkpoints) == {"a": (32, 1)}
    block = table.req_to_blocks["a"][1]
    assert kv.managers.pool.blocks[block].block_hash is None
    # nothing of it is offered or counted as cached this step
    assert all(o[2] != block for o in table.align.offloads)


def test_a_checkpoint_on_a_block_boundary_keeps_its_full_key() -> None:
    kv, impl = _pair()
    a = new_request("a", list(range(26)), 4)
    kv, _ = manager.allocate_slots(kv, a, 26)
    impl.allocate_slots(a, 26)
    assert impl.snapshot() == kv
    block = kv.managers.tables[1].req_to_blocks["a"][1]
    assert dict(kv.managers.tables[1].align.checkpoints) == {"a": (24, 1)}
    assert kv.managers.pool.blocks[block].hash_num_tokens == 24


def test_a_consumer_with_a_checkpoint_copies_and_keeps_it() -> None:
    """A resend of 49 tokens resumes at 28 (inside block 2): its copy replaces the hit in its
    table, and its chunk's checkpoint (48) keeps block 3."""
    kv, impl = _pair()
    a = new_request("a", list(range(29)), 4)
    kv, _ = manager.allocate_slots(kv, a, 29)
    impl.allocate_slots(a, 29)
    kv, _ = manager.free(kv, "a")
    impl.free(with_computed(a, 29))
    kv, _ = manager.new_step_starts(kv)
    impl.new_step_starts()
    b = new_request("b", list(range(49)), 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    impl_hit, _, _ = impl.get_computed_blocks(b)
    assert num_hit == 28
    kv, new = manager.allocate_slots(kv, b, 21, num_hit, hit)
    impl_new = impl.allocate_slots(b, 21, num_hit, impl_hit)
    assert new is not None and impl_new is not None
    assert [[x.block_id for x in g] for g in impl_new.blocks] == [list(g) for g in new]
    assert impl.snapshot() == kv
    table = kv.managers.tables[1]
    assert dict(table.align.checkpoints) == {"b": (48, 3)}
    row = table.req_to_blocks["b"]
    (copy,) = kv.pending_copies
    assert copy[0] == hit[1][2] and row[2] == copy[1] and row[3] != 0 and len(row) == 5
    # the prompt's checkpoint: block 3 keyed at 48, inside block 4's span
    assert kv.managers.pool.blocks[row[3]].hash_num_tokens == 48


@pytest.mark.parametrize("reserved", [(1, 0), (1, 4), (2, 4)])
def test_speculative_blocks_beside_the_copies_model_and_impl(reserved: tuple[int, int]) -> None:
    """A producer's partial tail and copy, then a consumer's copy, with speculative blocks
    (and checkpoints): the model and the impl agree call by call."""
    from tests.request.test_mamba_fine import _producer_then_consumer

    specs = (full_attention(4), mamba_reserving(12, *reserved))
    setup = ManagerSetup(48, specs, 64, 4)
    model_target, impl_target = ModelManagerTarget(setup), ImplManagerTarget(setup)
    answers = _producer_then_consumer(model_target)
    assert answers == _producer_then_consumer(impl_target)


@pytest.mark.usefixtures("require_vllm_manager")
@pytest.mark.parametrize("reserved", [(1, 0), (1, 4), (2, 4)])
def test_speculative_blocks_beside_the_copies_match_vllms(reserved: tuple[int, int]) -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget
    from tests.request.test_mamba_fine import _producer_then_consumer

    setup = ManagerSetup(48, (full_attention(4), mamba_reserving(12, *reserved)), 64, 4)
    model = _producer_then_consumer(ModelManagerTarget(setup))
    assert model == _producer_then_consumer(VllmManagerTarget(setup))


def _relocating_producer(target: Any) -> list[Any]:
    """34 tokens in chunks of 12, 20 and 2: the second chunk passes the speculative blocks
    (moved to the end) and stops at the prompt's partial boundary (32, inside Mamba block
    2); the third copies the producer's state there."""
    a = new_request("a", list(range(34)), 4)
    answers: list[Any] = []
    for start, num_new in ((0, 12), (12, 20), (32, 2)):
        answers.append(target.allocate_slots(with_computed(a, start), num_new))
        answers.append(target.get_block_ids("a"))
        copies = target.take_kv_cache_block_copies()
        answers.append(copies)
        target.free_blocks(list(copies[1]))
        target.new_step_starts()
    return answers


@pytest.mark.parametrize("reserved", [(1, 0), (2, 0), (1, 4)])
def test_a_producer_moves_its_speculative_blocks_model_and_impl(reserved: tuple[int, int]) -> None:
    setup = ManagerSetup(48, (full_attention(4), mamba_reserving(12, *reserved)), 64, 4)
    model = _relocating_producer(ModelManagerTarget(setup))
    assert model == _relocating_producer(ImplManagerTarget(setup))
    first, second = model[1][1], model[4][1]
    if reserved[1]:
        # the checkpoint's column (1, at 28) keeps the speculative block in place
        assert second[1] == first[1]
    else:
        # moved to the end (a null in its place), past the second chunk's state block
        assert second[1] == 0 and first[1] in second[2:]
    # the third chunk copies the producer's state at 32 (none with a checkpoint recorded:
    # the checkpoint's caching replaced the partial tail's)
    assert bool(model[8][0]) is not bool(reserved[1])


@pytest.mark.usefixtures("require_vllm_manager")
@pytest.mark.parametrize("reserved", [(1, 0), (2, 0), (1, 4)])
def test_a_producer_moves_its_speculative_blocks_as_vllm(reserved: tuple[int, int]) -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(48, (full_attention(4), mamba_reserving(12, *reserved)), 64, 4)
    model = _relocating_producer(ModelManagerTarget(setup))
    assert model == _relocating_producer(VllmManagerTarget(setup))


# --------------------------------------------------------------------------
# Lock-step runs
# --------------------------------------------------------------------------


def _scope(target: Any) -> ManagerTargetSpec:
    from kvpool.model import DEFAULT_PROFILE

    return ManagerTargetSpec(
        target,
        layouts=MAMBA_FINE_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(2, 3, 4),
        min_window=2,
        scheduler_calls=True,
        mamba_reserves=((0, 1), (0, 2), (1, 0), (2, 0), (1, 1)),
    )


def test_impl_conforms_with_checkpoints() -> None:
    report = run_request_conformance(
        _scope(ImplManagerTarget), hypothesis_profile="ci", max_examples=100
    )
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


@pytest.mark.usefixtures("require_vllm_manager")
def test_vllm_conforms_with_checkpoints() -> None:
    from kvpool.specs.targets.vllm.request import mamba_fine_scope

    scope = replace(mamba_fine_scope(), mamba_reserves=((0, 1), (0, 2), (1, 0), (2, 0), (1, 1)))
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=200)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 200


# --------------------------------------------------------------------------
# A planted bug the ground truth finds without the model
# --------------------------------------------------------------------------


class TransientCheckpointKeepsItsKey(MambaFineReservingManager):
    """BUG: a transient checkpoint's block keeps the full-block key it took this call,
    though the worker wrote a later state (the checkpoint's) into it."""

    def _cache_checkpoint(self, request: Any, blocks: Any, checkpoint: tuple[int, int]) -> None:
        position, _ = checkpoint
        hbs = self.block_pool.hash_block_size
        prompt = reserve.checkpoint_position(num_prompt_tokens(request), hbs)
        if position % self.block_size and position != prompt:
            return
        super()._cache_checkpoint(request, blocks, checkpoint)


class TransientKeyTarget(ImplManagerTarget):
    class manager_class(KVCacheManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for g, m in enumerate(self.managers):
                if isinstance(m, MambaFineReservingManager):
                    self.managers[g] = TransientCheckpointKeepsItsKey(
                        m.kv_cache_spec, self.block_pool, g
                    )


def test_the_ground_truth_alone_finds_a_transient_checkpoint_left_keyed() -> None:
    machine = manager_machine(
        TransientKeyTarget,
        layouts=MAMBA_FINE_LAYOUTS,
        block_factors=(2, 3, 4),
        lockstep=False,
        mamba_reserves=((0, 1), (0, 2), (1, 0), (2, 0), (1, 1)),
    )
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=1000,
        stateful_step_count=40,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    with pytest.raises(RequestInvariantViolation) as info:
        run_state_machine_as_test(machine, settings=chosen)
    assert info.value.name in ("cached_blocks_hold_their_prefix", "hit_matches_request")
