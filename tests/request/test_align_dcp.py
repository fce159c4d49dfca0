"""Mamba "align" beside sharded full attention under decode context parallelism
(kvpool.model.align_dcp): model, impl and vLLM 0.33.

vLLM 0.33.0 turns hash-block hits on under DCP as soon as a Mamba "align" block is one
hash block (``partial_hash_hits_enabled``), so a hit may end inside a sharded
full-attention block. The scenario of vLLM's own
``test_prefix_cache_hit_uses_per_group_dcp_geometry`` (tests/v1/core/test_prefix_caching.py)
is told again on every target; vLLM is optional: those comparisons skip, visibly,
without it, and fail without it under ``KVPOOL_REQUIRE_VLLM=1``.
"""

from dataclasses import replace
from typing import Any

import pytest

import kvpool.model.manager as manager
from kvpool.impl.align_dcp import check_dcp_config
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import align_dcp
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import (
    KVCacheSpec,
    full_attention,
    mamba_align,
    mamba_reserving,
    sliding_window,
)
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import MAMBA_ALIGN_DCP_LAYOUTS, ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget

REPLICATED = replace(full_attention(4), dcp_sharded=False)
SPECS = (full_attention(4), REPLICATED, mamba_align(4))
"""Hash blocks of 4 tokens: full attention sharded over 2 ranks (blocks of 8), a replicated
full-attention group of 4 (a draft model's) and Mamba blocks of 4, never sharded."""


def _rejected(specs: tuple[KVCacheSpec, ...], match: str, **kwargs: Any) -> None:
    with pytest.raises(InvalidManagerConfig, match=match):
        manager.new_kv_cache_manager(16, specs, 64, hash_block_size=4, dcp_world_size=2, **kwargs)
    with pytest.raises(InvalidManagerConfig, match=match):
        KVCacheManager(KVCacheConfig(16, specs), 64, hash_block_size=4, dcp_world_size=2, **kwargs)


# --------------------------------------------------------------------------
# What stays refused, by name
# --------------------------------------------------------------------------


def test_invalid_align_dcp_beside_a_sliding_window() -> None:
    window = replace(sliding_window(4, 4), dcp_sharded=False)
    _rejected((full_attention(4), window, mamba_align(4)), "beside a sliding_window group")


def test_invalid_align_dcp_with_reserved_blocks() -> None:
    reserving = mamba_reserving(4, num_speculative_blocks=1)
    _rejected((full_attention(4), reserving), "speculative or prefill checkpoint blocks")


def test_invalid_align_dcp_with_eagle() -> None:
    """The manager refuses EAGLE where hits end inside a sharded block (kvpool.model.align_dcp
    names it; EAGLE beside "align" elsewhere is kvpool.model.mamba_align_eagle's)."""
    _rejected((full_attention(4), mamba_align(4)), "EAGLE", use_eagle=True)
    specs = (full_attention(8), mamba_align(4))
    for verify in (align_dcp.verify, check_dcp_config):
        with pytest.raises(InvalidManagerConfig, match="with EAGLE is not modelled"):
            verify(specs, 4, True, None)


def test_invalid_align_dcp_with_sparse_retention() -> None:
    specs = (full_attention(8), mamba_align(4))
    for verify in (align_dcp.verify, check_dcp_config):
        with pytest.raises(InvalidManagerConfig, match="sparse retention"):
            verify(specs, 4, False, 8)


def test_invalid_align_of_several_hash_blocks_under_dcp() -> None:
    """Hits inside a Mamba block under DCP: not modelled (kvpool.model.mamba_fine_config)."""
    _rejected((full_attention(4), mamba_align(8)), "dcp_world_size=2 is not modelled")


def test_invalid_align_dcp_with_caching_off() -> None:
    """No hits: vLLM's geometry without them is not modelled; the refusal names it."""
    _rejected((full_attention(4), mamba_align(4)), "dcp_world_size=1", enable_caching=False)


def test_a_refused_configuration_leaves_nothing_behind() -> None:
    """The check is pure: the specs it read are what they were."""
    specs = (full_attention(4), sliding_window(4, 4), mamba_align(4))
    before = tuple(specs)
    for verify in (align_dcp.verify, check_dcp_config):
        with pytest.raises(InvalidManagerConfig):
            verify(specs, 4, False, None)
    assert specs == before


def test_enabled_only_under_dcp_with_caching_and_one_hash_block_per_align_block() -> None:
    sharded = (full_attention(8), mamba_align(4))
    assert align_dcp.enabled(sharded, 4, True, 2)
    assert not align_dcp.enabled(sharded, 4, False, 2)
    assert not align_dcp.enabled(sharded, 4, True, 1)
    assert not align_dcp.enabled((full_attention(8), mamba_align(8)), 4, True, 2)
    assert not align_dcp.enabled((full_attention(8),), 4, True, 2)


# --------------------------------------------------------------------------
# vLLM's scenario, and a hit inside a sharded block
# --------------------------------------------------------------------------


def _vllm_scenario(target: Any, shared_draft: bool) -> list[Any]:
    """test_prefix_cache_hit_uses_per_group_dcp_geometry, at hash blocks of 4 and dcp 8: a
    first chunk ends on the 64-token shared prefix (a state there), the second request hits
    it all."""
    sharded = 4 * 8
    common = [i for i in range(2) for _ in range(sharded)]
    a = new_request("0", [*common, *[99] * 7], 4)
    answers: list[Any] = [target.get_computed_blocks(a)]
    answers.append(target.allocate_slots(a, len(common)))
    answers.append(target.allocate_slots(with_computed(a, len(common)), 7))
    target.new_step_starts()
    b = new_request("1", [*common, *[100] * 5], 4)
    hit, num_hit = target.get_computed_blocks(b)
    answers.append((hit, num_hit))
    assert num_hit == 2 * sharded
    assert [len(group) for group in hit] == [2, 2 if shared_draft else 16, 16]
    target.free(with_computed(a, len(common) + 7))
    target.free(b)
    return answers


def _scenario_setup(shared_draft: bool) -> ManagerSetup:
    draft = full_attention(4) if shared_draft else REPLICATED
    specs = (full_attention(4), draft, mamba_align(4))
    return ManagerSetup(64, specs, 8192, 4, dcp_world_size=8)


@pytest.mark.parametrize("shared_draft", [False, True])
def test_vllms_per_group_dcp_scenario_on_model_and_impl(shared_draft: bool) -> None:
    setup = _scenario_setup(shared_draft)
    model = _vllm_scenario(ModelManagerTarget(setup), shared_draft)
    assert _vllm_scenario(ImplManagerTarget(setup), shared_draft) == model


@pytest.mark.usefixtures("require_vllm_manager")
@pytest.mark.parametrize("shared_draft", [False, True])
def test_vllms_per_group_dcp_scenario_as_vllm(shared_draft: bool) -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = _scenario_setup(shared_draft)
    model = _vllm_scenario(ModelManagerTarget(setup), shared_draft)
    assert _vllm_scenario(VllmManagerTarget(setup), shared_draft) == model


def _hit_inside_a_sharded_block(target: Any) -> list[Any]:
    """A 14-token prompt computed as 12 + 2 keys its tail at 12 inside the second sharded
    block (8..16) and a Mamba state at 12; a request sharing 12 tokens resumes there, not at
    the scheduler block (8), and copies the partial block it writes on."""
    a = new_request("a", list(range(14)), 4)
    answers: list[Any] = [target.allocate_slots(a, 12)]
    answers.append(target.allocate_slots(with_computed(a, 12), 2))
    target.new_step_starts()
    b = new_request("b", [*range(12), 90, 91, 92], 4)
    hit, num_hit = target.get_computed_blocks(b)
    answers.append((hit, num_hit))
    answers.append(target.allocate_slots(b, 3, num_hit, hit))
    answers.append(target.take_kv_cache_block_copies())
    answers.append(target.get_block_ids("b"))
    return answers


def test_a_hit_ends_inside_a_sharded_block_model_and_impl() -> None:
    setup = ManagerSetup(32, SPECS, 64, 4, dcp_world_size=2)
    model = _hit_inside_a_sharded_block(ModelManagerTarget(setup))
    assert model[2][1] == 12
    assert _hit_inside_a_sharded_block(ImplManagerTarget(setup)) == model


@pytest.mark.usefixtures("require_vllm_manager")
@pytest.mark.parametrize("specs", [SPECS, (REPLICATED, full_attention(4), mamba_align(4))])
def test_a_hit_ends_inside_a_sharded_block_as_vllm(specs: tuple[KVCacheSpec, ...]) -> None:
    """Also with the replicated group first: the adapter builds only that group unsharded."""
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(32, specs, 64, 4, dcp_world_size=2)
    model = _hit_inside_a_sharded_block(ModelManagerTarget(setup))
    assert _hit_inside_a_sharded_block(VllmManagerTarget(setup)) == model


def _boundary_evicted_then_prompt_done(target: Any) -> list[Any]:
    """The prompt's boundary state (4 of 5 tokens) loses its key to ``evict_blocks``; the last
    token's step caches 5 tokens. With hits on hash blocks vLLM 0.33.0 does not round that
    down to the Mamba block (``_align_cacheable``), so the boundary is not keyed again and a
    resend of the prompt hits only the state at 2. (Found by ``kvpool check --layer request --target
    impl --level 2``'s Mamba "align" part: the model rounded, as without hits on hash blocks.)"""
    prompt = [1, 2, 2, 1, 1]
    a = new_request("a", prompt, 2)
    answers: list[Any] = [target.allocate_slots(a, 2)]
    answers.append(target.allocate_slots(with_computed(a, 2), 2))
    state_block = answers[-1][1][0]
    target.evict_blocks({state_block})
    answers.append(target.allocate_slots(with_computed(a, 4), 1))
    target.new_step_starts()
    answers.append(target.get_computed_blocks(new_request("b", prompt, 2)))
    return answers


BOUNDARY_SETUP = ManagerSetup(8, (full_attention(2), mamba_align(2)), 16, 2, dcp_world_size=2)


def test_an_evicted_boundary_is_not_keyed_again_past_it_model_and_impl() -> None:
    model = _boundary_evicted_then_prompt_done(ModelManagerTarget(BOUNDARY_SETUP))
    assert model[-1][1] == 2, model[-1]
    assert _boundary_evicted_then_prompt_done(ImplManagerTarget(BOUNDARY_SETUP)) == model


@pytest.mark.usefixtures("require_vllm_manager")
def test_an_evicted_boundary_is_not_keyed_again_past_it_as_vllm() -> None:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    model = _boundary_evicted_then_prompt_done(ModelManagerTarget(BOUNDARY_SETUP))
    assert _boundary_evicted_then_prompt_done(VllmManagerTarget(BOUNDARY_SETUP)) == model


# --------------------------------------------------------------------------
# The machine draws it: the impl in lock-step, and vLLM compared
# --------------------------------------------------------------------------


def test_impl_conforms_on_the_dcp_layouts() -> None:
    from kvpool.model import DEFAULT_PROFILE

    scope = ManagerTargetSpec(
        ImplManagerTarget,
        layouts=MAMBA_ALIGN_DCP_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        scheduler_calls=True,
        context_parallel=((2, 1), (4, 1)),
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


@pytest.mark.usefixtures("require_vllm_manager")
def test_vllm_conforms_on_the_dcp_layouts() -> None:
    from kvpool.specs.targets.vllm.request import mamba_align_scope

    scope = replace(mamba_align_scope(), layouts=MAMBA_ALIGN_DCP_LAYOUTS)
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=300)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 300
