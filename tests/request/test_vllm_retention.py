"""Sparse retention: kvpool's model against vLLM 0.33's own KVCacheManager under
``prefix_cache_retention_interval`` (``kvpool.model.retention``).

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import os
from dataclasses import replace

import pytest

from kvpool.model.request import new_request
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup

EXAMPLES = 3000 if os.environ.get("KVPOOL_HYPOTHESIS") == "deep" else 300
"""Programs drawn: 300 by default, ten times more in a deep run (tests/conftest.py)."""


pytestmark = pytest.mark.usefixtures("require_vllm_manager")


def test_vllm_sparse_retention_conforms_at_level_1() -> None:
    from kvpool.specs.targets.vllm.request import retention_scope

    report = run_request_conformance(
        retention_scope(), hypothesis_profile="ci", max_examples=EXAMPLES
    )
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= EXAMPLES


def test_vllm_align_retention_conforms_at_level_1() -> None:
    """Mamba "align" states under every interval drawn sparse (``mamba_align_scope``'s
    layouts with a bare "align" group or speculative blocks; retention always on)."""
    from kvpool.specs.request.target import MAMBA_ALIGN_LAYOUTS
    from kvpool.specs.targets.vllm.request import mamba_align_scope

    scope = replace(
        mamba_align_scope(),
        layouts=MAMBA_ALIGN_LAYOUTS,
        retentions=(0, 0, 1, 2, 3),
        mamba_reserves=((0, 0), (0, 0), (1, 0), (2, 0)),
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=EXAMPLES)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= EXAMPLES


def test_vllm_033_declares_sparse_retention_and_older_releases_do_not() -> None:
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE, VllmManagerFactory

    assert any(r is not None for r in VLLM_SCOPE.retentions)
    assert "retentions" not in VllmManagerFactory().declared_scope()  # 0.33 takes them all


def test_the_shared_prefix_junction_is_kept_as_in_vllm() -> None:
    """test_swa_shared_prefix_reuse_under_zero_retention[False] on the model and on vLLM: the
    scheduler notes the junction on the request; the sibling's chunk up to it keeps the
    window there, and a third request reuses it."""
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(
        64,
        (full_attention(16), sliding_window(16, 16)),
        256,
        16,
        retention_interval=0,
    )
    shared = [7] * 32
    answers = []
    for target in (ModelManagerTarget(setup), VllmManagerTarget(setup)):
        target.allocate_slots(new_request("0", shared + [50] * 32, 16), 64)
        second = new_request("1", shared + [60] * 32, 16)
        hit, num_hit, boundary = target.get_computed_blocks_with_boundary(second)
        target.allocate_slots(replace(second, shared_prefix_boundary=boundary), 32, num_hit, hit)
        third = target.get_computed_blocks(new_request("2", shared + [70] * 32, 16))
        answers.append((num_hit, boundary, third))
    assert answers[0] == answers[1]
    assert answers[0][:2] == (0, 32) and answers[0][2][1] == 32
