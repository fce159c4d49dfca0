"""EAGLE beside a Mamba "align" group: kvpool's model and impl against vLLM 0.33's own
KVCacheManager (``kvpool.model.mamba_align_eagle``).

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import os
from dataclasses import replace
from typing import Any

import pytest

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import full_attention, mamba_align
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from tests.request.align_programs import RESEND_SETUP, latest_only_sibling, resend_scenario

EXAMPLES = 2000 if os.environ.get("KVPOOL_HYPOTHESIS") == "deep" else 200
"""Programs drawn: 200 by default, ten times more in a deep run (tests/conftest.py)."""

pytestmark = pytest.mark.usefixtures("require_vllm_manager")


def _targets(setup: ManagerSetup) -> list[Any]:
    from kvpool.specs.targets.impl.request import ImplManagerTarget
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    return [ModelManagerTarget(setup), ImplManagerTarget(setup), VllmManagerTarget(setup)]


def test_vllm_with_eagle_beside_align_conforms_at_level_1() -> None:
    """``mamba_align_eagle_scope()``: EAGLE half the time, flagged groups, speculative
    blocks, dense and sparse retention, the scheduler's calls."""
    from kvpool.specs.targets.vllm.request import mamba_align_eagle_scope

    report = run_request_conformance(
        mamba_align_eagle_scope(), hypothesis_profile="ci", max_examples=EXAMPLES
    )
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= EXAMPLES


def test_vllms_aligned_resend_scenario_answers_alike() -> None:
    """vLLM 0.33's test_hybrid_mamba_retention_mtp_resend_of_aligned_prompt (scaled to
    blocks of 4): every answer of the model, the impl and vLLM's manager equal."""
    answers = [resend_scenario(target) for target in _targets(RESEND_SETUP)]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][-1][1] == 12


def test_the_boundary_keyed_beside_the_full_blocks_is_offered_as_by_vllm() -> None:
    """The prompt's EAGLE boundary (5 of 6 tokens), off the scheduler's blocks of 2 and so
    left out by retention 0, is keyed in the call that cached its block: vLLM 0.33 offers
    it, so do the model and the impl."""
    setup = replace(
        ManagerSetup(8, (full_attention(2), mamba_align(1)), 16, 1, use_eagle=True),
        retention_interval=0,
    )
    offers = []
    for target in _targets(setup):
        request = new_request("r", [1, 2, 2, 1, 1, 2], 1)
        hit, num_hit, _ = target.get_computed_blocks_with_boundary(request)
        target.allocate_slots(request, 5, num_hit, hit)
        offers.append(target.take_boundary_state_offloads())
    assert offers[0] == offers[1] == offers[2]
    assert [tokens for _, _, tokens in offers[0]["r"]] == [5]


@pytest.mark.parametrize("eagle", [True, False])
def test_the_state_kept_under_latest_only_retention_is_vllms(eagle: bool) -> None:
    """With EAGLE the prompt's boundary and the replay boundary move to 8, where no state
    was computed: vLLM keeps no state, and the sibling misses; without EAGLE it hits 10."""
    setup = replace(
        ManagerSetup(8, (mamba_align(2),), 16, 2, use_eagle=eagle), retention_interval=0
    )
    answers = [latest_only_sibling(target) for target in _targets(setup)]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1][1] == (0 if eagle else 10)


@pytest.mark.parametrize("eagle", [True, False])
def test_the_per_group_lookup_answers_as_vllms_under_eagle(eagle: bool) -> None:
    prompt = [i for i in range(4) for _ in range(4)]
    setup = ManagerSetup(32, (full_attention(4), mamba_align(4)), 64, 4, use_eagle=eagle)
    answers = []
    for target in _targets(setup):
        first = new_request("a", [*prompt, 5, 5, 5, 5], 4)
        for start, num_new in ((0, 4), (4, 4), (8, 4), (12, 8)):
            target.allocate_slots(with_computed(first, start), num_new)
            target.new_step_starts()
        answers.append(target.get_computed_blocks_for_connector(new_request("b", [*prompt, 7], 4)))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0][1] == (12 if eagle else 16)
