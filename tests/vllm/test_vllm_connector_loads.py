"""A KV connector's loads (``kvpool.model.external``): kvpool's model against vLLM 0.33's own
KVCacheManager on external tokens, reserved blocks and groups not zeroed."""

from typing import Any

import pytest

from kvpool.model.request import new_request
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup

pytestmark = pytest.mark.usefixtures("require_vllm")


def test_vllm_conforms_on_a_connector_s_loads() -> None:
    from kvpool.specs.targets.vllm.request import connector_scope

    report = run_request_conformance(connector_scope(), hypothesis_profile="ci", max_examples=300)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 300


def test_hits_at_the_free_queue_s_head_are_not_handed_out_again_as_in_vllm() -> None:
    """vLLM's issue #33775: one group's blocks for external tokens must not evict another
    group's hit, free at the head of the queue; every group takes its hit first."""
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(24, (full_attention(4), sliding_window(4, 8)), 64, 4)
    answers: list[Any] = []
    for target in (ModelManagerTarget(setup), VllmManagerTarget(setup)):
        warm = new_request("w", list(range(33)), 4)
        target.allocate_slots(warm, 33)
        target.free(warm)
        request = new_request("r", list(range(40)), 4)
        hit, num_hit = target.get_computed_blocks(request)
        blocks = target.allocate_slots(request, 4, num_hit, hit, 0, False, False, 4, 2, (1,))
        answers.append((num_hit, blocks, target.get_block_ids("r"), target.num_free_blocks()))
    assert answers[0] == answers[1]
    tables = answers[0][2]
    real = [b for group in tables for b in group if b != 0]
    assert len(real) == len(set(real))


def test_a_release_without_reserved_blocks_is_not_sent_a_connector_s_loads() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvpool.specs.targets.vllm.request import VllmManagerFactory

    class Older(KVCacheManager):
        """allocate_slots as before vLLM 0.33: no reserved blocks."""

        def allocate_slots(
            self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0
        ) -> Any:
            return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens)

    assert "connector_loads" not in VllmManagerFactory().declared_scope()
    assert VllmManagerFactory(Older).declared_scope()["connector_loads"] is False
