"""The fast KV cache manager is atomic for any argument, well-typed or not (issue 20).

Random calls with randomly ill-typed arguments (requests missing fields or with
fields of the wrong type, counts that are strings, hits that are not blocks of
the pool, ids that are not strings) on managers in random states: a call either
succeeds with the pool's invariants and the tables' reference counts intact, or
raises one of the model's named errors with the snapshot exactly as before.
"""

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.impl import BlockPool, KVCacheBlock, KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.model import PoolError
from kvpool.model.request import new_request
from kvpool.model.single_type import full_attention, sliding_window
from kvpool.specs.request.invariants import ref_counts_match_tables

OTHER = BlockPool(4, True, 2)

BASE = new_request("r", (1, 2, 1, 2, 1, 2, 1), 2)

JUNK: list[Any] = [
    None,
    "7",
    7.0,
    True,
    -1,
    [],
    object(),
    OTHER.blocks[1],
    KVCacheBlock(1),
    SimpleNamespace(request_id="x"),
    replace(BASE, request_id=7),  # type: ignore[arg-type]
    replace(BASE, num_computed_tokens="0"),  # type: ignore[arg-type]
    replace(BASE, block_hashes=("h", 5)),  # type: ignore[arg-type]
    KVCacheBlocks(([OTHER.blocks[1]],)),
    KVCacheBlocks(([None],)),  # type: ignore[list-item]
]


def build(data: st.DataObject) -> KVCacheManager:
    """A manager with a few requests holding blocks, some cached."""
    specs = data.draw(
        st.sampled_from([(full_attention(2),), (full_attention(2), sliding_window(2, 3))])
    )
    manager = KVCacheManager(
        KVCacheConfig(data.draw(st.integers(4, 10)), specs),
        max_model_len=16,
        enable_caching=data.draw(st.booleans()),
        enable_kv_cache_events=data.draw(st.booleans()),
    )
    for rid in data.draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3)):
        request = new_request(rid, BASE.prompt_token_ids, 2)
        manager.allocate_slots(request, data.draw(st.integers(1, 7)))
    return manager


def requests() -> st.SearchStrategy[Any]:
    return st.sampled_from([BASE, new_request("a", BASE.prompt_token_ids, 2)])


def argument(data: st.DataObject, manager: KVCacheManager, kind: str) -> Any:
    if data.draw(st.booleans()):
        return data.draw(st.sampled_from(JUNK))
    blocks = st.sampled_from(manager.block_pool.blocks[1:])
    well_typed: dict[str, st.SearchStrategy[Any]] = {
        "request": requests(),
        "int": st.integers(-1, 8),
        "hits": st.none()
        | st.builds(
            lambda groups: KVCacheBlocks(tuple(groups)),
            st.lists(st.lists(blocks, max_size=2), min_size=len(manager.specs), max_size=2),
        ),
        "bool": st.booleans(),
        "id": st.sampled_from(["a", "b", "zz"]),
        "ids": st.sets(st.integers(-1, 12), max_size=3),
    }
    return data.draw(well_typed[kind])


OPERATIONS: dict[str, tuple[str, ...]] = {
    "get_computed_blocks": ("request",),
    "truncate_computed_blocks": ("hits", "int"),
    "estimate_cached_tokens": ("request",),
    # vLLM 0.33's parameters in its order: external tokens, delay, encoder tokens, whole
    # sequence, reserved blocks, scheduled requests, groups not zeroed
    "allocate_slots": (
        *("request", "int", "int", "hits", "int", "int", "bool", "int", "bool", "int", "bool"),
        "ids",
    ),
    "free": ("request",),
    "cache_blocks": ("request", "int"),
    "evict_blocks": ("ids",),
    "get_num_common_prefix_blocks": ("id",),
    "get_blocks": ("id",),
    "get_block_ids": ("id",),
    "pop_blocks_for_free": ("request",),
    "remove_skipped_blocks": ("id", "int"),
    "get_block_ids_for_computed_tokens": ("id", "int"),
    "get_computed_blocks_for_connector": ("request",),
    "record_blocks_for_zeroing": ("id", "int"),
    "finalize_partial_tail_offloads": ("request",),
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_a_call_with_any_arguments_succeeds_whole_or_changes_nothing(
    operation: str, data: st.DataObject
) -> None:
    manager = build(data)
    args = [argument(data, manager, kind) for kind in OPERATIONS[operation]]
    before = manager.snapshot()
    method: Callable[..., Any] = getattr(manager, operation)
    try:
        result = method(*args)
    except PoolError:
        assert manager.snapshot() == before
    else:
        if operation == "pop_blocks_for_free":
            # the scheduler's later free of what it popped, last first
            manager.block_pool.free_blocks(result[::-1])
    manager.block_pool.check_invariants()
    state = manager.snapshot()
    groups = state.managers.tables
    rids = {r for table in groups for r in table.req_to_blocks}
    tables = {rid: [table.req_to_blocks.get(rid, ()) for table in groups] for rid in rids}
    retained = [b for pair in state.pending_copies for b in pair]
    assert ref_counts_match_tables(state.managers.pool, tables, retained) is None


def test_every_scheduler_facing_operation_is_covered() -> None:
    # Callables only: the compiled build lists instance attributes on the class too.
    public = {
        n
        for n in dir(KVCacheManager)
        if not n.startswith("_") and callable(getattr(KVCacheManager, n))
    }
    not_calls = {"usage", "snapshot", "find_longest_cache_hit", "create_kv_cache_blocks"}
    without_arguments = {
        "reset_prefix_cache",
        "make_prefix_cache_stats",
        "take_events",
        "take_kv_cache_block_copies",
        "take_new_block_ids",
        "new_step_starts",
        "take_boundary_state_offloads",
    }
    assert public - not_calls - without_arguments == set(OPERATIONS)
