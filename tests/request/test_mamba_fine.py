"""Hits inside a Mamba "align" block (kvpool.model.mamba_fine): model, impl and vLLM 0.33.

A Mamba block of several hash blocks beside full attention:
a chunk ending on the prompt's partial boundary keys the state there, the
producer's next step copies it, and a later request resumes from that state
(inside the block) through a private copy of its own. vLLM is optional: the
tests that compare with it skip, visibly, without it, and fail without it under
``KVPOOL_REQUIRE_VLLM=1``.
"""

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvpool.model.mamba_fine as fine
import kvpool.model.manager as manager
import kvpool.model.single_type as single
from kvpool.impl.mamba_fine import MambaFineManager
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model.errors import InvalidManagerConfig, InvalidTokenCount, UnknownGroup
from kvpool.model.pool import new_pool
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import (
    KVCacheSpec,
    full_attention,
    mamba_align,
    sliding_window,
)
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import MAMBA_FINE_LAYOUTS, ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget

SPECS = (full_attention(4), mamba_align(12))
"""Hash blocks of 4 tokens, Mamba blocks of 3 of them."""


def _rejected(specs: tuple[KVCacheSpec, ...], match: str, **kwargs: Any) -> None:
    with pytest.raises(InvalidManagerConfig, match=match):
        manager.new_kv_cache_manager(16, specs, 64, hash_block_size=4, **kwargs)
    with pytest.raises(InvalidManagerConfig, match=match):
        KVCacheManager(KVCacheConfig(16, specs), 64, hash_block_size=4, **kwargs)


# --------------------------------------------------------------------------
# What stays refused, by name
# --------------------------------------------------------------------------


def test_invalid_fine_align_group_alone() -> None:
    _rejected((mamba_align(12),), "as the only group")


def test_invalid_fine_align_group_beside_other_groups() -> None:
    _rejected((sliding_window(4, 8), mamba_align(12)), "beside a sliding_window group")
    _rejected((sliding_window(8, 8), mamba_align(8)), "beside a sliding_window group")


def test_invalid_fine_align_group_with_eagle() -> None:
    _rejected(SPECS, "EAGLE", use_eagle=True)


def test_invalid_fine_align_group_with_sparse_retention() -> None:
    with pytest.raises(InvalidManagerConfig, match="sparse retention"):
        manager.new_kv_cache_manager(16, SPECS, 64, hash_block_size=4, retention_interval=0)


def test_invalid_fine_align_group_with_decode_context_parallelism() -> None:
    _rejected(SPECS, "dcp_world_size=2", dcp_world_size=2)


def test_invalid_fine_hit_of_negative_length() -> None:
    pool = new_pool(8, hash_block_size=4)
    with pytest.raises(InvalidTokenCount):
        fine.find_hit(pool, 12, [b"a"], -1, [0])


def test_invalid_copying_allocation_in_a_group_not_align() -> None:
    m = manager.new_kv_cache_manager(16, SPECS, 64, hash_block_size=4).managers
    m, _ = single.save_new_computed_blocks(m, 0, "r", [])
    before = m
    with pytest.raises(UnknownGroup):
        single.allocate_mamba_copy(m, 0, "r", 4, None)
    assert m == before


def test_invalid_copying_allocation_for_an_unknown_request() -> None:
    from kvpool.model.errors import UnknownRequest

    m = manager.new_kv_cache_manager(16, SPECS, 64, hash_block_size=4).managers
    before = m
    with pytest.raises(UnknownRequest):
        single.allocate_mamba_copy(m, 1, "nobody", 4, None)
    assert m == before


# --------------------------------------------------------------------------
# The semantics, call by call
# --------------------------------------------------------------------------


def test_full_attention_of_several_hash_blocks_beside_it_is_accepted() -> None:
    """Its hits and copies may end inside its blocks too (kvpool.model.copy_on_write)."""
    manager.new_kv_cache_manager(16, (full_attention(8), mamba_align(12)), 64, hash_block_size=4)
    KVCacheManager(KVCacheConfig(16, (full_attention(8), mamba_align(12))), 64, hash_block_size=4)


def test_partial_boundary_leaves_the_look_ahead_after_it() -> None:
    """vLLM 0.33.0's get_mamba_prefill_checkpoint_position without EAGLE."""
    assert fine.partial_boundary(1249, 16, 0) == fine.partial_boundary(1249, 16, 1) == 1248
    assert fine.partial_boundary(1249, 16, 2) == 1232
    assert fine.partial_boundary(1, 16, 0) == 0


def _producer_then_consumer(target: Any) -> list[Any]:
    """A producer stops at its prompt's partial boundary (20 of 22 tokens: inside its second
    Mamba block), runs on, finishes; a consumer sharing 21 tokens resumes at 20."""
    prompt = list(range(22))
    a = new_request("a", prompt, 4)
    answers: list[Any] = [target.allocate_slots(a, 20)]
    target.new_step_starts()
    answers.append(target.allocate_slots(with_computed(a, 20), 2))
    answers.append(target.take_kv_cache_block_copies())
    _, retained = answers[-1]
    target.free_blocks(list(retained))
    target.new_step_starts()
    target.free(with_computed(a, 22))
    b = new_request("b", [*prompt[:21], 99, 98], 4)
    hit, num_hit = target.get_computed_blocks(b)
    answers.append((hit, num_hit))
    answers.append(target.allocate_slots(b, 3, num_hit, hit))
    answers.append(target.take_kv_cache_block_copies())
    answers.append(target.get_block_ids("b"))
    return answers


def test_a_producer_copy_then_a_consumer_copy_model_and_impl() -> None:
    setup = ManagerSetup(32, SPECS, 64, 4)
    model = _producer_then_consumer(ModelManagerTarget(setup))
    impl = _producer_then_consumer(ImplManagerTarget(setup))
    assert model == impl
    (hit, num_hit) = model[3]
    # the consumer resumes from the state after exactly 20 tokens, inside Mamba block 1
    assert num_hit == 20 and len(hit[1]) == 2 and hit[1][0] == 0
    # the producer's copy: its block (source) to a fresh one that took the key
    (producer_copy,), _ = model[2]
    assert hit[1][1] == producer_copy[1]
    # the consumer's copy: that state to a private block, which replaces it in its table
    (consumer_copy,), _ = model[5]
    assert consumer_copy[0] == producer_copy[1] and model[6][1][1] == consumer_copy[1]


def test_a_finishing_producer_hands_its_tail_over() -> None:
    """A producer that finishes at its partial boundary hands the state where it is; one that
    ran past it hands nothing (vLLM 0.33.0's finalize_partial_tail_offload)."""
    import kvpool.model.scheduler_calls as calls

    kv = manager.new_kv_cache_manager(32, SPECS, 64, hash_block_size=4)
    impl = KVCacheManager(KVCacheConfig(32, SPECS), 64, hash_block_size=4)
    a = new_request("a", list(range(22)), 4)
    kv, _ = manager.allocate_slots(kv, a, 20)
    impl.allocate_slots(a, 20)
    source = kv.managers.tables[1].req_to_blocks["a"][1]
    kv, model_tail = calls.finalize_partial_tail_offloads(kv, with_computed(a, 20))
    impl_tail = impl.finalize_partial_tail_offloads(with_computed(a, 20))
    assert model_tail == ((1, source, 20),) and list(model_tail) == impl_tail
    # consumed: asked again, nothing
    kv, again = calls.finalize_partial_tail_offloads(kv, with_computed(a, 20))
    assert again == () and impl.finalize_partial_tail_offloads(with_computed(a, 20)) == []
    assert impl.snapshot() == kv


def test_a_chunk_past_the_boundary_keys_nothing_inside_the_block() -> None:
    kv = manager.new_kv_cache_manager(32, SPECS, 64, hash_block_size=4)
    a = new_request("a", list(range(22)), 4)
    kv, _ = manager.allocate_slots(kv, a, 22)
    align = kv.managers.tables[1].align
    assert dict(align.partial_hits) == {} and dict(align.producer_tails) == {}


# --------------------------------------------------------------------------
# Lock-step runs
# --------------------------------------------------------------------------


def test_impl_conforms_on_the_fine_layouts() -> None:
    from kvpool.model import DEFAULT_PROFILE

    scope = ManagerTargetSpec(
        ImplManagerTarget,
        layouts=MAMBA_FINE_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(2, 3, 4),
        min_window=2,
        scheduler_calls=True,
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


@pytest.mark.usefixtures("require_vllm_manager")
def test_vllm_conforms_on_the_fine_layouts() -> None:
    from kvpool.specs.targets.vllm.request import mamba_fine_scope

    report = run_request_conformance(mamba_fine_scope(), hypothesis_profile="ci", max_examples=200)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 200


@pytest.mark.usefixtures("require_vllm_manager")
def test_producer_and_consumer_copies_match_vllms() -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(32, SPECS, 64, 4)
    model = _producer_then_consumer(ModelManagerTarget(setup))
    vllm = _producer_then_consumer(VllmManagerTarget(setup))
    assert model == vllm


@pytest.mark.usefixtures("require_vllm_manager")
def test_the_connector_lookup_hits_inside_the_block_as_vllm() -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = replace(ManagerSetup(32, SPECS, 64, 4), log_stats=True)
    answers = []
    for target in (ModelManagerTarget(setup), ImplManagerTarget(setup), VllmManagerTarget(setup)):
        a = new_request("a", list(range(22)), 4)
        target.allocate_slots(a, 20)
        target.new_step_starts()
        b = new_request("b", [*range(21), 99], 4)
        answers.append(target.get_computed_blocks_for_connector(b))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1:] == (20, 0, False)


# --------------------------------------------------------------------------
# A planted bug the ground truth finds without the model
# --------------------------------------------------------------------------


class KeysStayOnTheProducersBlock(MambaFineManager):
    """BUG: the producer's next step makes no copy: the boundary's key stays on the
    producer's own block, which its forward pass overwrites with a later state."""

    def allocate_with_copy(self, request_id: str, num_tokens: int, hit: Any) -> Any:
        if hit is None and request_id in self._partial_hit_reqs:
            del self._partial_hit_reqs[request_id]
            self._producer_partial_tail_reqs.pop(request_id, None)
            return self.allocate_new_blocks(request_id, num_tokens), None
        return super().allocate_with_copy(request_id, num_tokens, hit)


class KeysStayTarget(ImplManagerTarget):
    class manager_class(KVCacheManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for g, m in enumerate(self.managers):
                if isinstance(m, MambaFineManager):
                    self.managers[g] = KeysStayOnTheProducersBlock(
                        m.kv_cache_spec, self.block_pool, g
                    )


def test_the_ground_truth_alone_finds_a_key_left_on_the_producers_block() -> None:
    """No model: after the producer's next step its block holds a later state under the
    boundary's key (or a request resumes from it)."""
    machine = manager_machine(
        KeysStayTarget,
        layouts=MAMBA_FINE_LAYOUTS,
        block_factors=(2, 3, 4),
        lockstep=False,
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
