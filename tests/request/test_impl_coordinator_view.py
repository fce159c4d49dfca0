"""``kvpool.impl.KVCacheManager.coordinator``: what vLLM 0.33's scheduler and engine core read
from its manager's coordinator, answered from the impl's own state and changing none of it."""

from types import SimpleNamespace

from kvpool.impl import KVCacheConfig, KVCacheManager
from kvpool.model.request import new_request
from kvpool.model.single_type import KVCacheSpec, full_attention, sliding_window


def test_the_groups_show_their_block_sizes_sharded_by_the_decode_world() -> None:
    replicated = KVCacheSpec(full_attention(4).attention, 4, dcp_sharded=False)
    manager = KVCacheManager(
        KVCacheConfig(32, (full_attention(4), replicated)),
        64,
        hash_block_size=4,
        dcp_world_size=2,
    )
    coordinator = manager.coordinator
    assert coordinator.group_block_sizes == (8, 4)
    assert [g.block_size for g in coordinator.single_type_managers] == [8, 4]
    assert [g.kv_cache_group_id for g in coordinator.single_type_managers] == [0, 1]


def test_each_group_shows_the_spec_object_the_caller_configured() -> None:
    """vLLM's engine core asks ``is_full_attention_spec(manager.kv_cache_spec)`` of each
    group: it must be the caller's own spec object, not kvpool's translation of it."""

    class FullAttentionSpec:  # a stand-in for vLLM's, read by its class name and fields
        block_size = 4

    theirs = SimpleNamespace(kv_cache_spec=FullAttentionSpec())
    config = SimpleNamespace(num_blocks=16, kv_cache_groups=[theirs])
    manager = KVCacheManager(config, 32, hash_block_size=4)
    (group,) = manager.coordinator.single_type_managers
    assert group.kv_cache_spec is theirs.kv_cache_spec
    assert manager.coordinator.retention_interval is None


def test_the_block_tables_read_are_copies() -> None:
    manager = KVCacheManager(
        KVCacheConfig(16, (full_attention(2), sliding_window(2, 2))), 32, hash_block_size=2
    )
    request = new_request("r", [1, 2, 3, 4, 5], 2)
    assert manager.allocate_slots(request, 5) is not None
    before = manager.snapshot()
    tables = [g.req_to_blocks for g in manager.coordinator.single_type_managers]
    assert [[b.block_id for b in t["r"]] for t in tables] == [
        list(ids) for ids in manager.get_block_ids("r")
    ]
    for table in tables:
        table["r"].clear()
        table["other"] = []
    assert manager.snapshot() == before
    assert all(
        len(t["r"]) == 3
        for t in (g.req_to_blocks for g in manager.coordinator.single_type_managers)
    )


def test_the_switches_are_the_manager_s() -> None:
    plain = KVCacheManager(KVCacheConfig(16, (full_attention(4),)), 32, hash_block_size=4)
    assert plain.coordinator.enable_partial_hash_hits is False
    assert plain.coordinator.num_reprefillable_tokens == 0
    fine = KVCacheManager(
        KVCacheConfig(16, (full_attention(4), full_attention(4))),
        32,
        hash_block_size=2,
        fine_grained_hits=True,
    )
    assert fine.coordinator.enable_partial_hash_hits is True
    ahead = KVCacheManager(
        KVCacheConfig(16, (full_attention(4),)),
        32,
        hash_block_size=4,
        use_eagle=True,
        num_prefill_lookahead=3,
    )
    assert ahead.coordinator.num_reprefillable_tokens == 2
