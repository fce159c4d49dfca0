"""The drop-in shapes without vLLM: the event hook, vLLM's key shape, the map view.

The comparison with vLLM's own pool, call for call, is tests/vllm/test_vllm_drop_in.py.
"""

from typing import Any, cast

import pytest

from kvpool.impl import BlockPool
from kvpool.impl.vllm_shape import CallerEvents, int64_hash, pool_key
from kvpool.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheRequest,
    InvalidArgument,
    UnknownBlock,
)
from tests.impl.helpers import assert_rejected

REQ = CacheRequest((b"h1", b"h2"), (1, 2, 3, 4))


def cached(strict: bool, **kwargs: Any) -> BlockPool:
    pool = BlockPool(4, True, 2, strict=strict, **kwargs)
    pool.cache_full_blocks(REQ, pool.get_new_blocks(2), 0, 2, 2, 1)
    return pool


def test_by_default_the_keys_are_kvpool_s_and_vllm_s_map_is_not_shown() -> None:
    pool = cached(strict=True)
    assert pool.blocks[1].block_hash == (b"h1", 1)
    assert not hasattr(pool, "cached_block_hash_to_block")


def test_not_strict_shows_keys_in_vllm_s_shape() -> None:
    pool = cached(strict=False)
    assert pool.blocks[1].block_hash == b"h1\0\0\0\1"
    assert pool.blocks[3].block_hash is None
    assert pool_key(pool.blocks[2].block_hash) == (b"h2", 1)
    the_map = pool.cached_block_hash_to_block
    assert len(the_map) == 2 and set(the_map._cache) == {b"h1\0\0\0\1", b"h2\0\0\0\1"}
    assert the_map.get_one_block(b"h2\0\0\0\1") is pool.blocks[2]
    assert the_map.get_one_block(b"h2\0\0\0\0") is None
    pool.check_invariants()


def test_the_hook_gets_every_event_with_its_request_and_queues_what_it_returns() -> None:
    seen: list[tuple[Any, Any]] = []

    def hook(event: Any, request: Any) -> Any:
        seen.append((event, request))
        return ("mine", type(event).__name__)

    pool = cached(strict=True, enable_kv_cache_events=True, event_hook=hook)
    pool.free_blocks(pool.blocks[1:3])
    pool.get_new_blocks(3)
    pool.free_blocks(pool.blocks[1:])
    pool.reset_prefix_cache()
    events: list[Any] = pool.take_events()
    assert events == [
        ("mine", "BlockStored"),
        ("mine", "BlockRemoved"),
        ("mine", "BlockRemoved"),
        ("mine", "AllBlocksCleared"),
    ]
    assert [r for _, r in seen] == [REQ, None, None, None]
    assert seen[1][0] == BlockRemoved(block_hashes=(b"h1",), medium="GPU", group_idx=1)


def test_caller_events_builds_the_caller_s_classes_with_converted_hashes() -> None:
    hook = CallerEvents(dict, dict, dict, external_hash=int64_hash)
    stored = BlockStored((b"\1" * 9,), b"\2", (1, 2), 2, None, "GPU", None, (None,), 0)
    got: Any = hook(stored, CacheRequest((), ()))
    assert got["block_hashes"] == [int.from_bytes(b"\1" * 8, "big")]
    assert got["parent_block_hash"] == 2 and got["token_ids"] == [1, 2]
    assert "session_id" not in got
    assert hook(AllBlocksCleared(), None) == {}
    # Without a converter the hashes stay kvpool's bytes.
    plain: Any = CallerEvents(dict, dict, dict)(stored, None)
    assert plain["block_hashes"] == [b"\1" * 9]


def test_a_request_s_session_goes_into_block_stored() -> None:
    class Request:
        block_hashes = (b"h1",)
        all_token_ids = (1, 2)
        session_id = "session-a"

    pool = BlockPool(
        3, True, 2, enable_kv_cache_events=True, event_hook=CallerEvents(dict, dict, dict)
    )
    pool.cache_full_blocks(Request(), pool.get_new_blocks(1), 0, 1, 2, 0)
    event: Any
    [event] = pool.take_events()
    assert event["session_id"] == "session-a"


@pytest.mark.parametrize("bad", [None, 3, "hook"])
def test_invalid_hook_is_not_callable(bad: Any) -> None:
    if bad is not None:
        with pytest.raises(InvalidArgument):
            BlockPool(3, True, 1, event_hook=bad)
    with pytest.raises(InvalidArgument):
        CallerEvents(dict, dict, dict, external_hash=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        CallerEvents(dict, "BlockRemoved", dict)  # type: ignore[arg-type]


def test_invalid_map_writes_are_named_and_change_nothing() -> None:
    pool = cached(strict=False)
    other = BlockPool(4, True, 2, strict=False)
    the_map = pool.cached_block_hash_to_block
    assert_rejected(pool, UnknownBlock, the_map.insert, b"k\0\0\0\0", other.blocks[1])
    assert_rejected(pool, UnknownBlock, the_map.insert, b"k\0\0\0\0", "block 1")
    assert_rejected(pool, InvalidArgument, the_map.insert, (b"k", 0), pool.blocks[3])
    assert_rejected(pool, InvalidArgument, the_map.insert, b"k", pool.blocks[3])
    entries = the_map._cache
    assert_rejected(pool, InvalidArgument, entries.__setitem__, b"k\0\0\0\0", {3: pool.blocks[3]})
    assert_rejected(pool, UnknownBlock, entries.__setitem__, b"k\0\0\0\0", other.blocks[3])
    assert_rejected(pool, InvalidArgument, the_map.pop, "k", 3)


def test_the_map_view_says_which_blocks_a_vllm_key_holds() -> None:
    pool = cached(strict=False)
    the_map = pool.cached_block_hash_to_block
    h1, h2 = b"h1\0\0\0\1", b"h2\0\0\0\1"
    assert the_map.contain(h1, 1) and not the_map.contain(h1, 2)
    assert not the_map.contain(b"h1\0\0\0\0", 1), "the same hash in another group"
    the_map.insert(h2, pool.blocks[3])  # a second block under h2: a shared entry
    assert the_map.contain(h2, 2) and the_map.contain(h2, 3) and not the_map.contain(h2, 1)


def test_the_shortest_vllm_key_is_the_group_alone() -> None:
    """vLLM's key is the hash then 4 group-id bytes: 4 bytes are an empty hash, 3 are no key."""
    assert pool_key(b"\0\0\0\7") == (b"", 7)
    with pytest.raises(InvalidArgument):
        pool_key(b"\0\0\7")


def test_caller_events_build_each_kind_with_none_fields_kept_none() -> None:
    made = CallerEvents(
        lambda **fields: ("stored", fields),
        lambda **fields: ("removed", fields),
        lambda: ("cleared", {}),
        external_hash=len,
    )
    removed = made(BlockRemoved(block_hashes=(b"abc",), medium="GPU", group_idx=2), None)
    assert removed == ("removed", {"block_hashes": [3], "medium": "GPU", "group_idx": 2})
    stored = BlockStored(
        block_hashes=(b"ab",),
        parent_block_hash=None,
        token_ids=(1, 2),
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=None,
        group_idx=0,
        lookahead_token_ids=None,
    )
    kind, fields = cast(tuple[str, dict[str, Any]], made(stored, None))
    assert kind == "stored" and fields["extra_keys"] is None and fields["block_hashes"] == [2]
    assert fields["parent_block_hash"] is None and fields["lookahead_token_ids"] is None


def test_the_map_view_pops_one_block_of_a_vllm_key() -> None:
    pool = cached(strict=False)
    the_map = pool.cached_block_hash_to_block
    h1, h2 = b"h1\0\0\0\1", b"h2\0\0\0\1"
    assert the_map.pop(b"zz\0\0\0\1", 1) is None and len(the_map) == 2
    assert the_map.pop(h1, 2) is None and the_map.contain(h1, 1), "another block's id"
    assert the_map.pop(h1, 1) is pool.blocks[1] and not the_map.contain(h1, 1)
    the_map.insert(h2, pool.blocks[3])
    assert the_map.pop(h2, 1) is None
    assert the_map.pop(h2, 3) is pool.blocks[3]
    assert the_map.contain(h2, 2) and not the_map.contain(h2, 3) and len(the_map) == 1


def test_the_entries_view_takes_vllm_s_entry_shapes() -> None:
    """A block, or a dict of two blocks or more by id, as vLLM's map holds them."""
    pool = cached(strict=False)
    other = BlockPool(4, True, 2, strict=False)
    entries = pool.cached_block_hash_to_block._cache
    mixed = {1: pool.blocks[1], 3: other.blocks[3]}
    assert_rejected(pool, UnknownBlock, entries.__setitem__, b"m\0\0\0\0", mixed)
    # Raw writes, as to vLLM's map: the blocks do not record the key (no invariant holds).
    key = b"k\0\0\0\0"
    entries[key] = pool.blocks[3]
    assert entries[key] is pool.blocks[3] and len(entries) == 3
    shared = {2: pool.blocks[2], 3: pool.blocks[3]}
    entries[key] = shared
    assert entries[key] == shared
    assert pool.cached_block_hash_to_block.contain(key, 2)
