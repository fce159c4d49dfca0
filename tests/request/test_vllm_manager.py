"""kvpool's manager model against vLLM's own KVCacheManager (vLLM 0.33 API).

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import importlib
import os

import pytest

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import chunked_local, sliding_window
from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
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


def test_vllm_manager_conforms_at_level_1() -> None:
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    report = run_manager_conformance(VLLM_SCOPE, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


def test_vllm_hybrid_managers_conform_at_level_1() -> None:
    """Two or three groups through vLLM's hybrid coordinator: two groups of one spec, the
    window listed first, two windows that shorten each other's hit."""
    from dataclasses import replace

    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    hybrids = tuple(layout for layout in VLLM_SCOPE.layouts if "+" in layout)
    assert len(hybrids) == 4
    scope = replace(VLLM_SCOPE, layouts=hybrids)
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"


def both(setup: ManagerSetup) -> tuple[object, object]:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    return ModelManagerTarget(setup), VllmManagerTarget(setup)


def test_vllm_033_releases_the_last_cached_block_of_an_old_chunk() -> None:
    """Seed 002 keeps a chunked-local request's last cached block; 0.33 releases it."""
    setup = ManagerSetup(2, (chunked_local(1, 1),), 16, 1)
    request = new_request("r", (1, 2, 2, 1), 1)
    answers = []
    for target in both(setup):
        assert target.allocate_slots(request, 1) == ((1,),)  # type: ignore[attr-defined]
        answers.append(target.allocate_slots(with_computed(request, 1), 1))  # type: ignore[attr-defined]
    assert answers == [None, ((1,),)]


def test_vllm_033_caches_no_sliding_window_block_for_a_window_of_one() -> None:
    """A window of one token needs no block for a hit: 0.33 caches none, the model all."""
    setup = ManagerSetup(8, (sliding_window(1, 1),), 16, 1)
    request = new_request("a", (1, 2, 2, 1), 1)
    later = new_request("b", (1, 2, 2, 1, 1), 1)
    hits = []
    for target in both(setup):
        target.allocate_slots(request, 4)  # type: ignore[attr-defined]
        hits.append(target.get_computed_blocks(later))  # type: ignore[attr-defined]
    assert hits == [(((0, 0, 0, 4),), 4), (((),), 0)]
