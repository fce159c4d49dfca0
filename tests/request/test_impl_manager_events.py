"""The impl's take_events stamps each BlockStored with its group's spec, as vLLM 0.33's manager.

The pool's own events carry no spec (the pool knows none); the manager's
``take_events`` adds the group's kind and sliding window (vLLM 0.33.0,
``KVCacheManager.take_events`` and ``kv_cache_event_metadata`` in
``vllm/v1/core/kv_cache_manager.py``). The request layer's protocol compares pool
events, so the impl's adapter checks the stamp and drops it.
"""

from dataclasses import replace
from typing import Any

import pytest

from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model.events import BlockRemoved, BlockStored
from kvpool.model.request import new_request
from kvpool.model.single_type import chunked_local, full_attention, sliding_window
from kvpool.specs.targets.manager_api import without_annotation

SPECS = (full_attention(2), sliding_window(2, 3), chunked_local(2, 4))


def manager() -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(12, SPECS), 16, enable_kv_cache_events=True)


def test_each_block_stored_carries_its_groups_kind_and_window() -> None:
    m = manager()
    m.allocate_slots(new_request("r", [1, 2, 3, 4, 5], 2), 5)
    stamps = {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        for e in m.take_events()
        if isinstance(e, BlockStored)
    }
    assert stamps == {
        (0, "full_attention", None),
        (1, "sliding_window", 3),
        (2, "chunked_local_attention", None),
    }


def test_the_pool_keeps_its_events_unstamped() -> None:
    m = manager()
    m.allocate_slots(new_request("r", [1, 2, 3], 2), 3)
    assert all(e.kv_cache_spec_kind is None for e in m.block_pool.take_events())  # type: ignore[union-attr]


class Hooked:
    """A caller's event class (what ``BlockPool.event_hook`` builds): mutable, own type."""

    def __init__(self, group_idx: int | None) -> None:
        self.group_idx = group_idx
        self.kv_cache_spec_kind: str | None = None
        self.kv_cache_spec_sliding_window: int | None = None


Hooked.__name__ = "BlockStored"


def test_a_callers_event_is_stamped_in_place() -> None:
    m = manager()
    event = Hooked(1)
    m.block_pool.kv_event_queue.append(event)
    assert m.take_events() == [event]  # type: ignore[comparison-overlap]  # a caller's own class
    assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("sliding_window", 3)


@pytest.mark.parametrize("group", [3, -1, None])
def test_an_event_of_no_known_group_passes_unstamped(
    group: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    m = manager()
    event = Hooked(group)
    m.block_pool.kv_event_queue.append(event)
    with caplog.at_level("WARNING", logger=KVCacheManager.logger.name):
        assert m.take_events() == [event]  # type: ignore[comparison-overlap]  # a caller's own class
    assert event.kv_cache_spec_kind is None
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ([] if group is None else [f"Group index `{group}` not in KV cache metadata"])


def test_a_vllm_config_names_mla_groups_as_vllm_does() -> None:
    class MLAAttentionSpec:
        block_size = 2

    class Group:
        kv_cache_spec = MLAAttentionSpec()

    config: Any = type("Config", (), {"num_blocks": 4, "kv_cache_groups": [Group()]})()
    assert KVCacheManager(config, 8).kv_cache_event_metadata == (("mla_attention", None),)


def test_the_adapter_drops_a_right_stamp_and_keeps_a_wrong_one() -> None:
    plain = BlockStored((b"h",), None, (1, 2), 2, None, "GPU", None, None, 1)
    right = replace(plain, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=3)
    wrong = replace(plain, kv_cache_spec_kind="full_attention")
    assert without_annotation(right, SPECS) == plain
    assert without_annotation(wrong, SPECS) == wrong
    removed = BlockRemoved((b"h",), "GPU", 1)
    assert without_annotation(removed, SPECS) == removed
