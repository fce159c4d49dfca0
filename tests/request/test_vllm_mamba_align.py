"""Mamba "align" mode: kvpool's model against vLLM 0.33's own KVCacheManager.

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

from dataclasses import replace
from typing import Any

import pytest

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, mamba_align
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from tests.request.align_programs import random_program

pytestmark = pytest.mark.usefixtures("require_vllm_manager")


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


def _targets(setup: ManagerSetup) -> list[Any]:
    from kvpool.specs.targets.impl.request import ImplManagerTarget
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    return [ModelManagerTarget(setup), ImplManagerTarget(setup), VllmManagerTarget(setup)]


def _chunks(target: Any, request: Any, chunks: list[tuple[int, int]]) -> list[Any]:
    answers = []
    for start, num_new in chunks:
        answers.append(target.allocate_slots(with_computed(request, start), num_new))
        target.new_step_starts()
    return answers


def test_a_small_mamba_block_beside_larger_blocks_hits_on_them_as_in_vllm() -> None:
    """A Mamba block of one hash block beside full attention's blocks of two: hits end on
    the larger blocks (the scheduler block), where vLLM 0.33 keeps fine-grained hits off;
    a state cached between two of them is no hit."""
    setup = ManagerSetup(32, (full_attention(8), mamba_align(4)), 64, 4)
    prompt = list(range(20))
    answers = []
    for target in _targets(setup):
        a = new_request("a", prompt, 4)
        allocated = _chunks(target, a, [(0, 12), (12, 4), (16, 4)])
        sibling = new_request("b", [*prompt[:17], 99], 4)
        hit = target.get_computed_blocks(sibling)
        state_at_16 = target.get_block_ids("a")[1][3]
        target.free(a)
        target.evict_blocks({state_at_16})
        answers.append((allocated, hit, target.get_computed_blocks(sibling)))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1][1] == 16 and answers[0][2] == (((), ()), 0)


def test_the_connector_lookup_per_group_matches_vllms() -> None:
    """``get_computed_blocks_for_connector`` beside a Mamba "align" group: full attention's
    hit flagged diverged when Mamba's state lags; the plain lookup when Mamba runs deeper
    or both agree."""
    setup = ManagerSetup(16, (full_attention(4), mamba_align(4)), 64, 4, log_stats=True)
    prompt = list(range(10))
    sibling = new_request("b", [*prompt[:9], 99], 4)
    answers = []
    for target in _targets(setup):
        a = new_request("a", prompt, 4)
        _chunks(target, a, [(0, 4), (4, 4)])
        agreeing = target.get_computed_blocks_for_connector(sibling)
        first = target.get_block_ids("a")
        target.free(a)
        target.evict_blocks({first[1][1]})  # Mamba's state after 8 tokens
        lagging = target.get_computed_blocks_for_connector(sibling)
        c = new_request("c", prompt, 4)
        _chunks(target, c, [(0, 4), (4, 4)])  # caches Mamba's state after 8 again
        again = target.get_block_ids("c")
        target.free(c)
        target.evict_blocks({first[0][1], again[0][1]})  # full attention's second blocks
        deeper = target.get_computed_blocks_for_connector(sibling)
        answers.append((agreeing, lagging, deeper, target.make_prefix_cache_stats()))
    assert answers[0] == answers[1] == answers[2]
    agreeing, lagging, deeper, _ = answers[0]
    assert (agreeing[1:], lagging[1:], deeper[1:]) == ((8, 0, False), (8, 0, True), (4, 0, False))


def test_whole_sequence_admission_counts_one_state_block_as_vllm() -> None:
    answers = []
    for num_blocks in (4, 5):
        setup = ManagerSetup(num_blocks, (full_attention(4), mamba_align(4)), 64, 4)
        for target in _targets(setup):
            r = new_request("a", list(range(10)), 4)
            got = target.allocate_slots(r, 4, 0, None, 0, False, full_sequence_must_fit=True)
            answers.append((num_blocks, got))
    assert answers[0] == answers[1] == answers[2] == (4, None)
    assert answers[3] == answers[4] == answers[5] and answers[3][1] is not None


def test_random_runs_beside_larger_blocks_match_vllm() -> None:
    """40 random runs on the geometries of ``GEOMETRIES`` (about 2,000 calls), model, impl
    and vLLM call by call; the runs do reach diverged connector hits and hits (about 100
    and 250 at these seeds)."""
    seen = {"diverged": 0, "hits": 0}
    for seed in range(40):
        counts = random_program(seed, _targets)
        for key, count in counts.items():
            seen[key] += count
    assert seen["diverged"] >= 50 and seen["hits"] >= 150, seen
