"""Mamba "align" mode: kvpool's model against vLLM 0.33's own KVCacheManager.

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import importlib
import os

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
