"""Mamba "align" mode: kvpool's model against vLLM 0.33's own KVCacheManager.

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import importlib
import os
from dataclasses import replace

import pytest

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, mamba_align
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup


@pytest.fixture(scope="module", autouse=True)
def require_vllm() -> None:
    try:
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as error:  # ImportError, or a dependency failing at import time
        reason = f"vLLM's KVCacheManager cannot be imported: {error!r}"
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_VLLM=1 to make this an error)")


def test_vllm_mamba_align_conforms_at_level_1() -> None:
    from kvpool.specs.targets.vllm.request import mamba_align_scope

    report = run_request_conformance(mamba_align_scope(), hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


def test_a_sibling_waits_a_step_for_a_state_cached_in_this_one_as_in_vllm() -> None:
    """The state of a boundary cached in this step is written by this step's forward: vLLM
    refuses the hit's allocation until the next step, and so does the model."""
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(16, (full_attention(4), mamba_align(4)), 64, 4)
    prompt = [i for i in range(3) for _ in range(4)] + [3, 3]
    answers = []
    for target in (ModelManagerTarget(setup), VllmManagerTarget(setup)):
        target.allocate_slots(new_request("a", prompt, 4), 12)
        sibling = new_request("b", [*prompt[:12], 9], 4)
        hit, num_hit = target.get_computed_blocks(sibling)
        refused = target.allocate_slots(sibling, 1, num_hit, hit)
        target.new_step_starts()
        admitted = target.allocate_slots(sibling, 1, num_hit, hit)
        later = target.allocate_slots(with_computed(sibling, 13), 1)
        answers.append((hit, num_hit, refused, admitted, later, target.get_block_ids("b")))
    assert answers[0] == answers[1]
    assert answers[0][:4] == (((1, 2, 3), (0, 0, 4)), 12, None, ((5,), (6,)))


def test_boundary_state_offers_match_vllms() -> None:
    """What ``take_boundary_state_offloads`` drains: the model's and the impl's seams against
    vLLM's own method, after three block-aligned chunks, a hit and a free."""
    import kvpool.model.manager as manager
    from kvpool.impl.mamba_align import take_boundary_state_offloads as impl_offers
    from kvpool.impl.manager import KVCacheConfig, KVCacheManager
    from kvpool.model.mamba_align import take_boundary_state_offloads as model_offers
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    specs = (full_attention(4), mamba_align(4))
    setup = ManagerSetup(16, specs, 64, 4)
    vllm = VllmManagerTarget(setup)
    kv = manager.new_kv_cache_manager(16, specs, 64)
    impl = KVCacheManager(KVCacheConfig(16, specs), 64)
    a = new_request("a", list(range(14)), 4)
    b = new_request("b", [*range(8), 9, 9], 4)
    answers = []
    for start, num_new in ((0, 4), (4, 4), (8, 4)):
        request = with_computed(a, start)
        vllm.allocate_slots(request, num_new)
        kv, _ = manager.allocate_slots(kv, request, num_new)
        impl.allocate_slots(request, num_new)
        vllm.new_step_starts()
        kv, _ = manager.new_step_starts(kv)
        impl.new_step_starts()
        tables, model_answer = model_offers([t.align for t in kv.managers.tables])
        kv = replace(
            kv,
            managers=replace(
                kv.managers,
                tables=tuple(
                    replace(t, align=d) for t, d in zip(kv.managers.tables, tables, strict=True)
                ),
            ),
        )
        answers.append(
            (model_answer, impl_offers(impl.managers), vllm.manager.take_boundary_state_offloads())
        )
    hit, num_hit = vllm.get_computed_blocks(b)
    vllm.allocate_slots(b, 2, num_hit, hit)
    vllm.free(a)
    assert vllm.manager.take_boundary_state_offloads() == {}
    for model_answer, impl_answer, vllm_answer in answers:
        assert {r: list(o) for r, o in model_answer.items()} == impl_answer == vllm_answer
    assert [len(m["a"]) for m, _, _ in answers] == [1, 1, 1]
