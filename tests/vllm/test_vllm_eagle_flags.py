"""EAGLE flagged on some KV cache groups only (vLLM 0.33's ``is_eagle_group``): kvpool's
model against vLLM 0.33's own KVCacheManager (``kvpool.model.eagle.group_flags``)."""

from typing import Any

import pytest

from kvpool.model.request import new_request
from kvpool.model.single_type import KVCacheSpec, full_attention, sliding_window
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup

pytestmark = pytest.mark.usefixtures("require_vllm")


def test_vllm_conforms_with_eagle_flagged_on_some_groups() -> None:
    from kvpool.specs.targets.vllm.request import eagle_flags_scope

    report = run_request_conformance(eagle_flags_scope(), hypothesis_profile="ci", max_examples=300)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 300


def answers(specs: tuple[KVCacheSpec, ...], flagged: tuple[int, ...]) -> list[Any]:
    """A 20-token prompt computed whole, then a sibling's hit, on the model and on vLLM."""
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(64, specs, 64, 4, use_eagle=True, eagle_groups=flagged)
    found = []
    for target in (ModelManagerTarget(setup), VllmManagerTarget(setup)):
        tokens = [i for i in range(5) for _ in range(4)]
        target.allocate_slots(new_request("a", tokens, 4), 20)
        found.append(target.get_computed_blocks(new_request("b", [*tokens, 99], 4)))
    return found


def test_a_flagged_window_caches_the_block_past_the_boundary_as_in_vllm() -> None:
    # vLLM 0.33's test_eagle_swa_boundary_caches_post_boundary_block, in miniature
    model, vllm = answers((full_attention(8), sliding_window(4, 4)), (1,))
    assert model == vllm
    assert model[1] == 16


def test_an_unflagged_sibling_of_a_flagged_window_is_an_eagle_group_too_as_in_vllm() -> None:
    # vLLM 0.33's test_eagle_grouped_swa_siblings_use_same_cache_mask: were the sibling
    # not EAGLE's, it would not cache the block past the boundary, and nothing would hit
    swa = sliding_window(4, 4)
    model, vllm = answers((full_attention(8), swa, swa), (2,))
    assert model == vllm
    assert model[1] == 16
