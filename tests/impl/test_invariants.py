"""Each structural invariant of check_invariants catches a hand-corrupted pool."""

from collections.abc import Callable

import pytest

from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.model import AllBlocksCleared
from tests.impl.helpers import REQ


def busy_pool(caching: bool = True, events: bool = False) -> BlockPool:
    """Held, free, cached, shared-key and partial-key blocks all at once.

    Free queue afterwards: [3, 4, 5, 6, 7, 2]; 1 and 8 are held.
    """
    pool = BlockPool(9, caching, 1, enable_kv_cache_events=events)
    blocks = pool.get_new_blocks(8)
    if caching:
        pool.cache_full_blocks(REQ, blocks[:2], 0, 2, 1, 0)
        pool.cache_full_blocks(REQ, [blocks[7]], 0, 1, 1, 0)  # shares (h0, 0) with block 1
        pool.cache_partial_block(REQ, blocks[0], 1, 1, 2)  # a partial key beside the primary
    pool.free_blocks(blocks[1:7])
    pool.check_invariants()
    return pool


Corruption = Callable[[BlockPool], None]


def _break_prev(pool: BlockPool) -> None:
    pool.blocks[5].prev_free_block = pool.blocks[7]


def _desync_count(pool: BlockPool) -> None:
    pool.free_block_queue.num_free_blocks += 1


def _cycle(pool: BlockPool) -> None:
    last = pool.blocks[2]
    last.next_free_block = pool.blocks[3]


def _gap(pool: BlockPool) -> None:
    pool.blocks[4].next_free_block = None


def _listed_but_held(pool: BlockPool) -> None:
    pool.blocks[4].ref_cnt = 1


def _free_but_unlisted(pool: BlockPool) -> None:
    pool.free_block_queue.remove(pool.blocks[4])


def _foreign_owner(pool: BlockPool) -> None:
    pool.blocks[6].pool = BlockPool(2, True, 1)


def _negative_ref(pool: BlockPool) -> None:
    pool.free_block_queue.remove(pool.blocks[4])
    pool.blocks[4].ref_cnt = -1


def _null_linked(pool: BlockPool) -> None:
    pool.free_block_queue.append(pool.null_block)


def _null_held(pool: BlockPool) -> None:
    pool.null_block.ref_cnt = 1


def _second_null(pool: BlockPool) -> None:
    pool.blocks[1].is_null = True


def _sentinel_prev(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_head.prev_free_block = pool.blocks[3]


def _sentinel_id(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_tail.block_id = 0


def _tail_prev(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_tail.prev_free_block = pool.blocks[3]


def _wrong_id(pool: BlockPool) -> None:
    pool.blocks[6].block_id = 5


def _key_lost_from_map(pool: BlockPool) -> None:
    del pool._map0[b"h1"]


def _map_points_at_a_stranger(pool: BlockPool) -> None:
    pool._map0[b"zz"] = pool.blocks[3]


def _one_block_dict(pool: BlockPool) -> None:
    pool._map0[b"h1"] = {2: pool.blocks[2]}


def _extra_without_primary(pool: BlockPool) -> None:
    pool.blocks[3]._extra_keys = [(b"h0", 1)]


def _tokens_without_primary(pool: BlockPool) -> None:
    pool.blocks[3]._block_hash_num_tokens = 4


def _key_recorded_twice(pool: BlockPool) -> None:
    block = pool.blocks[1]
    assert block._extra_keys is not None
    block._extra_keys.append(block._extra_keys[0])


def _block_forgets_its_key(pool: BlockPool) -> None:
    pool.blocks[2].reset_hash()


def _null_hashed(pool: BlockPool) -> None:
    pool.null_block._hash = b"n"
    pool.null_block._block_hash_num_tokens = 1
    pool._map0[b"n"] = pool.null_block


def _extra_block(pool: BlockPool) -> None:
    pool.blocks.append(KVCacheBlock(9, pool=pool))


def _not_a_block(pool: BlockPool) -> None:
    pool.blocks[5] = object()  # type: ignore[call-overload]


def _null_moved(pool: BlockPool) -> None:
    pool.null_block = pool.blocks[1]


def _sentinel_held(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_head.ref_cnt = 1


def _sentinel_hashed(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_tail._hash = b"x"


def _sentinel_owned(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_head.pool = pool


def _one_sentinel(pool: BlockPool) -> None:
    queue = pool.free_block_queue
    queue.fake_free_list_tail = queue.fake_free_list_head


def _after_tail(pool: BlockPool) -> None:
    pool.free_block_queue.fake_free_list_tail.next_free_block = pool.blocks[3]


def _stranger_listed(pool: BlockPool) -> None:
    stranger = KVCacheBlock(4)
    own = pool.blocks[4]
    prev, nxt = own.prev_free_block, own.next_free_block
    assert prev is not None and nxt is not None
    prev.next_free_block = stranger
    nxt.prev_free_block = stranger
    stranger.prev_free_block, stranger.next_free_block = prev, nxt
    own.ref_cnt = 1


def _empty_extra_list(pool: BlockPool) -> None:
    pool.blocks[2]._extra_keys = []


def _map_points_at_a_copy(pool: BlockPool) -> None:
    copy = KVCacheBlock(2, pool=pool)
    copy._hash, copy._block_hash_num_tokens = b"zz", 2
    pool._map0[b"zz"] = copy


CORRUPTIONS: dict[str, tuple[Corruption, str]] = {
    "a block too many": (_extra_block, "10 blocks for num_gpu_blocks=9"),
    "not a block": (_not_a_block, "blocks[5] is a object"),
    "null_block is not block 0": (_null_moved, "null_block is not blocks[0]"),
    "a held sentinel": (_sentinel_held, "fake head has ref_cnt"),
    "a hashed sentinel": (_sentinel_hashed, "fake tail carries a hash"),
    "a sentinel owned by the pool": (_sentinel_owned, "fake head claims"),
    "one sentinel for both ends": (_one_sentinel, "one block"),
    "something after the tail": (_after_tail, "follows the fake tail"),
    "a stranger in the list": (_stranger_listed, "does not belong to the pool"),
    "an empty extra-key list": (_empty_extra_list, "empty extra-key list"),
    "map points at a copy of a block": (_map_points_at_a_copy, "not this pool's block 2"),
    "break a prev pointer": (_break_prev, "prev_free_block is not"),
    "desync num_free_blocks": (_desync_count, "num_free_blocks="),
    "make a cycle": (_cycle, "cycle"),
    "cut the list": (_gap, "breaks off"),
    "hold a listed block": (_listed_but_held, "is listed"),
    "unlist a free block": (_free_but_unlisted, "is not listed"),
    "a block owned by another pool": (_foreign_owner, "blocks[6] belongs to"),
    "negative ref count": (_negative_ref, "ref_cnt -1"),
    "link the null block": (_null_linked, "null block is in the free list"),
    "hold the null block": (_null_held, "null block is held"),
    "a second null block": (_second_null, "is_null"),
    "something before the head": (_sentinel_prev, "precedes the fake head"),
    "sentinel with a real id": (_sentinel_id, "fake tail has block_id"),
    "tail points at the wrong last block": (_tail_prev, "block -1: prev_free_block is not"),
    "block id off its index": (_wrong_id, "has block_id"),
    "key lost from the map": (_key_lost_from_map, "does not point back"),
    "map points at a block without the key": (_map_points_at_a_stranger, "does not record it"),
    "dict entry with one block": (_one_block_dict, "dict of 1 block"),
    "extra keys without a primary key": (_extra_without_primary, "no primary key"),
    "token count without a primary key": (_tokens_without_primary, "disagree"),
    "a key recorded twice by one block": (_key_recorded_twice, "records a key twice"),
    "a block forgets a key the map still has": (_block_forgets_its_key, "does not record it"),
    "the null block hashed": (_null_hashed, "null block carries a hash"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_check_invariants_catches(name: str) -> None:
    corrupt, message = CORRUPTIONS[name]
    pool = busy_pool()
    corrupt(pool)
    with pytest.raises(AssertionError) as info:
        pool.check_invariants()
    text = str(info.value)
    assert message in text.splitlines()[0]
    # sortedcontainers style: the message carries a dump of the whole pool.
    assert "free list (front first" in text and "hash map:" in text
    assert all(f"block_id={i}," in text for i in range(1, 5))


def test_caching_disabled_pool_with_a_cached_key_is_caught() -> None:
    pool = busy_pool(caching=False)
    block = pool.blocks[1]
    block._hash, block._block_hash_num_tokens = b"x", 1
    pool._map0[b"x"] = block
    with pytest.raises(AssertionError, match="without prefix caching"):
        pool.check_invariants()


def test_events_on_a_pool_without_events_are_caught() -> None:
    pool = busy_pool()
    pool.kv_event_queue.append(AllBlocksCleared())
    with pytest.raises(AssertionError, match="without events"):
        pool.check_invariants()


def test_an_intact_pool_passes_in_every_shape() -> None:
    busy_pool(caching=False).check_invariants()
    busy_pool(events=True).check_invariants()
    BlockPool(1, True, 1).check_invariants()


def test_the_dump_shows_the_whole_pool() -> None:
    pool = BlockPool(5, True, 1, enable_kv_cache_events=True)
    a, b, c = pool.get_new_blocks(3)
    for block in (a, b):
        pool.cache_full_blocks(REQ, [block], 0, 1, 1, 0)  # one key, two blocks
    pool.cache_full_blocks(REQ, [a, c], 1, 2, 1, 0)
    pool.free_blocks([c, b, a])
    lines = pool._dump().splitlines()
    assert lines[1] == "  num_free_blocks=4"
    assert lines[2] == "  fake head: next=4, prev=None"
    assert lines[3] == "  fake tail: prev=1, next=None"
    assert lines[4] == "  free list (front first, bounded walk): [4, 3, 2, 1]"
    assert lines[5] == "  blocks:" and len([x for x in lines if "block_id=" in x]) == 5
    assert lines[11] == "  hash map:"
    assert lines[12].endswith("-> [1, 2]") and lines[13].endswith("-> 3")
    assert lines[14] == "  pending events: 3"


def test_the_dump_of_a_cycle_stops_and_says_so() -> None:
    pool = BlockPool(4, True, 1)
    first, second = pool.blocks[1], pool.blocks[2]
    second.next_free_block = first  # 1 -> 2 -> 1 -> ...
    walk = next(x for x in pool._dump().splitlines() if "free list" in x)
    assert walk == "  free list (front first, bounded walk): [1, 2, 1, 2, 1, ...]"
