"""kvpool.impl as a drop-in for vLLM 0.33's BlockPool: vLLM's shapes, call for call.

A kvpool pool built with ``strict=False`` and ``CallerEvents`` over vLLM's
event classes and vLLM's hash conversion, and vLLM's own pool, get the same
calls; what vLLM's managers and tests read (events, ``block.block_hash``,
``cache_partial_block``'s key, the ``cached_block_hash_to_block`` map) must
come out equal (docs/vllm-conformance.md, the drop-in).
"""

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.impl import BlockPool
from kvpool.impl.vllm_shape import CallerEvents

pytestmark = pytest.mark.usefixtures("require_vllm")

BLOCK = 2


def request(num_tokens: int, salt: int = 0, **extra: Any) -> Any:
    """What both pools read of a request: hashes of BLOCK tokens, the tokens, LoRA, session."""
    fields: dict[str, Any] = {
        "request_id": f"r{salt}",
        "block_hashes": [bytes([salt, i + 1]) * 16 for i in range(num_tokens // BLOCK)],
        "all_token_ids": list(range(salt, salt + num_tokens)),
        "num_tokens": num_tokens,
        "lora_request": None,
        "session_id": None,
        "mm_features": [],
        "cache_salt": None,
        "prompt_embeds": None,
    }
    fields.update(extra)
    return SimpleNamespace(**fields)


def pools(num_blocks: int = 8) -> tuple[Any, BlockPool]:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hook = CallerEvents(
        BlockStored, BlockRemoved, AllBlocksCleared, external_hash=maybe_convert_block_hash
    )
    vllm = VllmBlockPool(num_blocks, True, BLOCK, enable_kv_cache_events=True)
    ours = BlockPool(
        num_blocks, True, BLOCK, enable_kv_cache_events=True, strict=False, event_hook=hook
    )
    return vllm, ours


def same_shapes(vllm: Any, ours: BlockPool) -> None:
    """Events, every block's hash, and the hash map (keys and block ids) agree."""
    assert ours.take_events() == vllm.take_events()
    assert [b.block_hash for b in ours.blocks] == [b.block_hash for b in vllm.blocks]
    assert [b.block_hash_num_tokens for b in ours.blocks] == [
        b.block_hash_num_tokens for b in vllm.blocks
    ]
    theirs = vllm.cached_block_hash_to_block
    mine = ours.cached_block_hash_to_block
    assert len(mine) == len(theirs)
    assert set(mine._cache) == set(theirs._cache)
    for key in theirs._cache:
        assert mine.get_one_block(key).block_id == theirs.get_one_block(key).block_id
    ours.check_invariants()


def both(vllm: Any, ours: BlockPool, name: str, *args: Any) -> tuple[Any, Any]:
    """The same call on both pools, blocks given by id."""

    def resolve(pool: Any, arg: Any) -> Any:
        if isinstance(arg, list) and arg and isinstance(arg[0], Block):
            return [pool.blocks[b.id] for b in arg]
        return pool.blocks[arg.id] if isinstance(arg, Block) else arg

    return (
        getattr(vllm, name)(*(resolve(vllm, a) for a in args)),
        getattr(ours, name)(*(resolve(ours, a) for a in args)),
    )


class Block:
    def __init__(self, block_id: int) -> None:
        self.id = block_id


def ids(*block_ids: int) -> list[Block]:
    return [Block(i) for i in block_ids]


def test_events_block_hashes_and_map_through_the_hook_equal_vllm_s() -> None:
    vllm, ours = pools()
    first = request(8, salt=1, session_id="session-a")
    second = request(6, salt=2)
    got = both(vllm, ours, "get_new_blocks", 4)
    assert [b.block_id for b in got[0]] == [b.block_id for b in got[1]]
    both(vllm, ours, "cache_full_blocks", first, ids(1, 2, 3, 4), 0, 2, BLOCK, 0)
    same_shapes(vllm, ours)
    # a continuation (a parent hash), in another group
    both(vllm, ours, "cache_full_blocks", first, ids(1, 2, 3, 4), 2, 4, BLOCK, 0)
    both(vllm, ours, "get_new_blocks", 3)
    both(vllm, ours, "cache_full_blocks", second, ids(5, 6, 7), 0, 3, BLOCK, 1)
    same_shapes(vllm, ours)
    both(vllm, ours, "emit_cached_block_events", first, 2, BLOCK, 0)
    same_shapes(vllm, ours)
    # freed and taken again: the cached blocks are evicted (a BlockRemoved per key)
    both(vllm, ours, "free_blocks", ids(4, 3, 2, 1, 7, 6, 5))
    taken = both(vllm, ours, "get_new_blocks", 5)
    assert [b.block_id for b in taken[0]] == [b.block_id for b in taken[1]]
    same_shapes(vllm, ours)
    both(
        vllm, ours, "cache_full_blocks", first, ids(*(b.block_id for b in taken[1])), 0, 4, BLOCK, 0
    )
    both(vllm, ours, "free_blocks", ids(*(b.block_id for b in taken[1])))
    assert both(vllm, ours, "reset_prefix_cache") == (True, True)
    same_shapes(vllm, ours)


def test_a_partial_entry_has_vllm_s_key_and_event() -> None:
    vllm, ours = pools()
    req = request(8, salt=3)
    both(vllm, ours, "get_new_blocks", 2)
    both(vllm, ours, "cache_full_blocks", req, ids(1, 2), 0, 1, BLOCK, 0)
    # block 2 holds tokens 2..3 of a block size 4 group: its first half is an entry
    keys = both(vllm, ours, "cache_partial_block", req, Block(2), 4, 0, 2 * BLOCK)
    assert keys[1] == keys[0] and type(keys[1]) is bytes
    same_shapes(vllm, ours)


def test_writes_through_the_map_view_act_as_on_vllm_s_map() -> None:
    """What vLLM's tests do to the map: insert, pop, and ``_cache`` pop and restore."""
    import copy

    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    vllm, ours = pools()
    key = make_block_hash_with_group_id(BlockHash(b"k" * 32), 1)
    pool: Any
    for pool in (vllm, ours):
        the_map = pool.cached_block_hash_to_block
        the_map.insert(key, pool.blocks[3])
        the_map.insert(key, pool.blocks[4])
        assert the_map.contain(key, 4) and not the_map.contain(key, 5)
        assert pool.get_cached_block(b"k" * 32, [1])[0].block_id == 3
        saved = copy.copy(the_map._cache)
        the_map._cache.pop(key)
        assert pool.get_cached_block(b"k" * 32, [1]) is None
        the_map._cache[key] = saved[key]
        assert the_map.pop(key, 3).block_id == 3
        assert the_map.get_one_block(key).block_id == 4
        assert the_map.pop(key, 9) is None
        assert the_map.pop(key, 4).block_id == 4
        assert len(the_map) == 0


def test_a_lora_request_s_event_differs_in_extra_keys_only() -> None:
    """vLLM's pool puts the LoRA name in ``extra_keys``; kvpool's pool layer leaves None."""
    import msgspec
    from vllm.lora.request import LoRARequest

    vllm, ours = pools()
    lora = request(4, salt=4, lora_request=LoRARequest("adapter", 7, "/nowhere"))
    both(vllm, ours, "get_new_blocks", 2)
    both(vllm, ours, "cache_full_blocks", lora, ids(1, 2), 0, 2, BLOCK, 0)
    mine: Any
    [theirs], [mine] = vllm.take_events(), ours.take_events()
    assert (mine.lora_id, mine.lora_name) == (theirs.lora_id, theirs.lora_name) == (7, "adapter")
    assert theirs.extra_keys == [("adapter",), ("adapter",)] and mine.extra_keys == [None, None]
    assert msgspec.structs.replace(mine, extra_keys=theirs.extra_keys) == theirs
