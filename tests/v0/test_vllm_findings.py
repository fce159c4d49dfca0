"""What comparing the model with vLLM 0.10.2's v0 allocator found, replayed on vLLM itself.

Each test runs vLLM's own allocator (through its adapter) and the model on the
same calls and pins down where they part; docs/semantics.md ("The v0
allocator") explains each. If a test here starts failing because vLLM's
behaviour changed, that section is out of date.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from kvpool.model import v0
from kvpool.model.v0 import V0Config, V0State
from kvpool.model.v0_errors import NotPromotable, UnfilledPrefix
from kvpool.specs.v0.model_target import ModelV0Target
from tests.v0.helpers import vllm_or_skip


def both(num_blocks: int, block_size: int) -> tuple[Any, ModelV0Target]:
    vllm_or_skip()
    from kvpool.specs.targets.vllm.v0 import VllmV0Target

    config = V0Config(num_blocks, block_size)
    return VllmV0Target(config), ModelV0Target(config)


def on_both(targets: tuple[Any, ModelV0Target], call: Callable[[Any], Any]) -> tuple[Any, Any]:
    return call(targets[0]), call(targets[1])


def _free(target: Any, handle: int) -> None:
    target.free(handle)


def test_marking_an_evictable_block_makes_it_unevictable_in_vllm() -> None:
    vllm, model = targets = both(1, 1)
    on_both(targets, lambda t: t.free(t.allocate_immutable_block(None, [1])))
    on_both(targets, lambda t: t.mark_blocks_as_accessed([0], 0))
    assert vllm.get_num_free_blocks() == model.get_num_free_blocks() == 1
    assert model.allocate_mutable_block(None) == 1  # the model evicts block 0
    with pytest.raises(ValueError, match="No usable cache memory left"):
        vllm.allocate_mutable_block(None)


def test_a_stale_heap_entry_crashes_vllms_eviction() -> None:
    vllm, model = targets = both(2, 1)
    for _ in range(2):
        handles = on_both(targets, lambda t: t.allocate_immutable_blocks(None, [[1], [2]]))
        assert tuple(handles[0]) == tuple(handles[1])
        for handle in handles[1]:
            on_both(targets, partial(_free, handle=handle))
    tail = on_both(targets, lambda t: t.allocate_mutable_block(None))[1]
    on_both(targets, lambda t: t.append_token_ids(tail, [3]))
    on_both(targets, lambda t: t.free(tail))
    assert vllm.snapshot() == model.snapshot()  # the states agree; vLLM's heap does not
    model.allocate_mutable_block(None)
    with pytest.raises(AssertionError):
        vllm.allocate_mutable_block(None)


def test_binary_search_counts_an_evicted_block_in_both() -> None:
    targets = both(3, 1)
    handles = on_both(targets, lambda t: t.allocate_immutable_blocks(None, [[1], [2], [3]]))[1]
    on_both(targets, lambda t: t.mark_blocks_as_computed([]))
    on_both(targets, lambda t: t.mark_blocks_as_accessed([0], 1))
    on_both(targets, lambda t: t.mark_blocks_as_accessed([1, 2], 2))
    for handle in handles:
        on_both(targets, partial(_free, handle=handle))
    on_both(targets, lambda t: t.allocate_mutable_block(None))  # evicts block 0
    hashes = v0.content_hashes([1, 2, 3], 1)
    found = on_both(targets, lambda t: tuple(t.find_cached_blocks_prefix(hashes)))
    assert found[0] == found[1] == hashes
    assert (1,) not in targets[1].snapshot().cached


def test_vllm_accepts_a_second_promotion_and_frees_a_held_block() -> None:
    vllm, model = both(2, 1)
    handle = vllm.allocate_mutable_block(None)
    vllm.append_token_ids(handle, [5])
    vllm.promote_to_immutable_block(handle)
    state: V0State = vllm.snapshot()
    assert state.blocks[0].ref_cnt == 1 and 0 in state.hashless_free  # held and free at once
    model.allocate_mutable_block(None)
    model.append_token_ids(0, [5])
    with pytest.raises(NotPromotable):
        v0.promote_to_immutable_block(model.state, 0)


def test_vllm_hashes_a_block_after_an_unfilled_one_without_its_prefix() -> None:
    vllm, _ = both(4, 1)
    first = vllm.allocate_mutable_block(None)  # never filled
    second = vllm.allocate_mutable_block(first)
    vllm.append_token_ids(second, [7])
    obj = vllm.objects[second]
    unchained = vllm.v0.block_class.hash_block_tokens(False, None, [7])
    assert obj.content_hash == unchained  # cached as if nothing came before it
    state, a = v0.allocate_mutable_block(v0.new_allocator(4, 1))
    state, b = v0.allocate_mutable_block(state, a)
    with pytest.raises(UnfilledPrefix):
        v0.append_token_ids(state, b, [7])
