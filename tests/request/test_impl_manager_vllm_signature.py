"""``kvpool.impl.KVCacheManager.allocate_slots`` takes vLLM 0.33's parameters in vLLM's order.

A vLLM caller passes them by position (vLLM's own tests do): a parameter kvpool does not model
must be refused by name there, never read as the next one kvpool does model.
"""

import inspect
from typing import Any

import pytest

from kvpool.impl import KVCacheConfig, KVCacheManager
from kvpool.model import InvalidArgument
from kvpool.model.request import new_request
from kvpool.model.single_type import full_attention
from kvpool.specs.targets.vllm.recorder import MANAGER

VLLM_033_ORDER = list(MANAGER["allocate_slots"][1])
"""``KVCacheManager.allocate_slots``' parameters in vLLM's order, as the history recorder
already lists them for vLLM's manager."""


def manager() -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(8, (full_attention(2),)), max_model_len=16)


def test_the_parameters_are_vllm_s_in_vllm_s_order() -> None:
    assert list(inspect.signature(KVCacheManager.allocate_slots).parameters)[1:] == VLLM_033_ORDER


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_encoder_tokens", 1),
        ("reserved_blocks", "1"),
        ("skip_zeroing_group_ids", 0),
        ("num_external_computed_tokens", True),
        ("has_scheduled_reqs", "yes"),
    ],
)
def test_invalid_unmodelled_argument_is_named_and_changes_nothing(name: str, value: Any) -> None:
    m = manager()
    m.allocate_slots(new_request("a", [1, 2, 3], 2), 3)
    before = m.snapshot()
    with pytest.raises(InvalidArgument, match=name):
        m.allocate_slots(new_request("b", [1, 2, 3], 2), 3, **{name: value})
    assert m.snapshot() == before


@pytest.mark.parametrize("delay", [True, False])
def test_a_positional_call_as_vllm_s_scheduler_makes_it_is_read_as_vllm_reads_it(
    delay: bool,
) -> None:
    m = manager()
    request = new_request("a", [1, 2, 3, 4], 2)
    # request, 4 new tokens, no hits, no look-ahead, no external tokens, delay, no encoder
    # tokens, no whole-sequence gate, no reserved blocks, requests scheduled, zero every group
    blocks = m.allocate_slots(request, 4, 0, None, 0, 0, delay, 0, False, 0, False, [])
    assert blocks is not None and blocks.get_block_ids() == ([1, 2],)
    _, num_hit, _ = m.get_computed_blocks(new_request("b", [1, 2, 3, 4, 5], 2))
    assert num_hit == (0 if delay else 4), "delay_cache_blocks was not read from its place"
