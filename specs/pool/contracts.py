"""Contracts on the model's operations, for CrossHair (PEP 316 docstring syntax).

Each contract builds a small pool from symbolic integers, runs one operation
and states what must hold afterwards. CrossHair searches the integers for a
counterexample; ``crosshair check kvpool.specs.pool.contracts`` runs them all.
The pools are built through the operations themselves, so every state a
contract starts from is reachable, and every postcondition is a property of
the *operation*, not of how the state was written down.

The last contracts are on the impl's internal free queue, the intrusive
linked list every pool operation rests on: they state its order in terms of
plain lists, the model's representation.

The same contracts run against deliberately broken operations in
``tests/crosshair/`` to show that none of them is vacuous.
"""

from kvpool import model
from kvpool.impl import BlockPool, KVCacheBlock
from kvpool.impl.free_queue import FreeKVCacheBlockQueue
from kvpool.model import CacheRequest, PoolState


def _last(queue: tuple[int, ...], n: int) -> tuple[int, ...]:
    return queue[len(queue) - n :]


def _hits(state: PoolState, i: int) -> bool:
    """Block i+1, cached under hash bytes([i+1]), is what a lookup finds."""
    return model.get_cached_block(state, bytes([i + 1]), [0]) == (i + 1,)


def pool_with_held(num_blocks: int, held: int, cached: int) -> PoolState:
    """A pool of ``num_blocks`` with ``held`` blocks taken and the first ``cached`` of them cached.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    post: len(__return__.free_queue) == num_blocks - 1 - held
    """
    state = model.new_pool(num_blocks)
    state, ids = model.get_new_blocks(state, held)
    hashes = tuple(bytes([i + 1]) for i in range(cached))
    state, _ = model.cache_full_blocks(state, CacheRequest(hashes), ids, 0, cached, 1, 0)
    return state


def get_new_blocks_takes_from_the_front(
    num_blocks: int, held: int, cached: int, n: int
) -> tuple[PoolState, PoolState, tuple[int, ...]]:
    """get_new_blocks hands out the queue's first n blocks, held once and hash-less.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    pre: 0 <= n <= num_blocks - 1 - held
    post: __return__[2] == __return__[0].free_queue[:n]
    post: __return__[1].free_queue == __return__[0].free_queue[n:]
    post: all(__return__[1].blocks[b].ref_cnt == 1 for b in __return__[2])
    post: all(not __return__[1].blocks[b].hash_keys() for b in __return__[2])
    """
    before = pool_with_held(num_blocks, held, cached)
    after, ids = model.get_new_blocks(before, n)
    return before, after, ids


def free_blocks_conserves_blocks(
    num_blocks: int, held: int, cached: int, first: int, count: int, reverse: bool
) -> tuple[PoolState, PoolState]:
    """Freeing held blocks returns exactly those blocks to the queue; none is lost.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    pre: 0 <= first <= first + count <= held
    post: len(__return__[1].free_queue) == len(__return__[0].free_queue) + count
    post: set(__return__[0].free_queue) <= set(__return__[1].free_queue)
    post: len(set(__return__[1].free_queue)) == len(__return__[1].free_queue)
    """
    before = pool_with_held(num_blocks, held, cached)
    freed = list(range(1 + first, 1 + first + count))
    if reverse:
        freed.reverse()
    after, _ = model.free_blocks(before, freed)
    return before, after


def free_blocks_puts_hashless_first(
    num_blocks: int, held: int, cached: int
) -> tuple[PoolState, PoolState]:
    """Under the default profile, the hash-less freed blocks lead the queue, in freeing order.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    post: __return__[1].free_queue[: held - cached] == tuple(range(held, cached, -1))
    post: _last(__return__[1].free_queue, cached) == tuple(range(cached, 0, -1))
    """
    before = pool_with_held(num_blocks, held, cached)
    after, _ = model.free_blocks(before, list(range(held, 0, -1)))
    return before, after


def touch_takes_a_reference(
    num_blocks: int, held: int, cached: int, block_id: int
) -> tuple[PoolState, PoolState, int]:
    """touch adds one reference and takes a free block out of the queue, keeping its hash.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    pre: 1 <= block_id < num_blocks
    post: __return__[1].blocks[block_id].ref_cnt == __return__[0].blocks[block_id].ref_cnt + 1
    post: block_id not in __return__[1].free_queue
    post: __return__[1].blocks[block_id].hash_keys() == __return__[0].blocks[block_id].hash_keys()
    """
    before = pool_with_held(num_blocks, held, cached)
    after, _ = model.touch(before, [block_id])
    return before, after, block_id


def cache_full_blocks_makes_blocks_hit(
    num_blocks: int, held: int, num_cached: int, num_full: int
) -> tuple[PoolState, int, int]:
    """After caching blocks [num_cached:num_full], each is found under its own hash.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= num_cached <= num_full <= held
    post: all(_hits(__return__[0], i) for i in range(num_cached, num_full))
    """
    state = pool_with_held(num_blocks, held, 0)
    hashes = tuple(bytes([i + 1]) for i in range(held))
    ids = list(range(1, held + 1))
    state, _ = model.cache_full_blocks(state, CacheRequest(hashes), ids, num_cached, num_full, 1, 0)
    return state, num_cached, num_full


def evict_blocks_drops_hashes_only(
    num_blocks: int, held: int, cached: int, block_id: int
) -> tuple[PoolState, PoolState, int]:
    """evict_blocks removes the block's hashes and changes nothing else.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    pre: 0 <= block_id < num_blocks
    post: not __return__[1].blocks[block_id].hash_keys()
    post: all(block_id not in ids for ids in __return__[1].cached.values())
    post: __return__[1].free_queue == __return__[0].free_queue
    post: __return__[1].blocks[block_id].ref_cnt == __return__[0].blocks[block_id].ref_cnt
    """
    before = pool_with_held(num_blocks, held, cached)
    after, _ = model.evict_blocks(before, [block_id])
    return before, after, block_id


def reset_prefix_cache_only_when_idle(
    num_blocks: int, held: int, cached: int, free_all: bool
) -> tuple[PoolState, PoolState, bool]:
    """reset succeeds exactly when no block is held, and then forgets every hash.

    pre: 1 <= num_blocks <= 6
    pre: 0 <= held < num_blocks
    pre: 0 <= cached <= held
    post: __return__[2] == (len(__return__[0].free_queue) == num_blocks - 1)
    post: (not __return__[2]) or not __return__[1].cached
    post: __return__[2] or __return__[1] == __return__[0]
    """
    before = pool_with_held(num_blocks, held, cached)
    if free_all:
        before, _ = model.free_blocks(before, list(range(1, held + 1)))
    after, done = model.reset_prefix_cache(before)
    return before, after, done


def hashes_at_block_size_picks_every_kth(
    hashes: list[bytes], hash_block_size: int, factor: int
) -> tuple[bytes, ...]:
    """A block of k hash blocks is named by the k-th, 2k-th, ... hash.

    pre: 1 <= hash_block_size <= 4
    pre: 1 <= factor <= 4
    post: len(__return__) == len(hashes) // factor
    post: all(__return__[i] == hashes[(i + 1) * factor - 1] for i in range(len(__return__)))
    """
    return model.hashes_at_block_size(hashes, hash_block_size, hash_block_size * factor)


def _ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def _linked_both_ways(queue: FreeKVCacheBlockQueue) -> bool:
    """Walking back from the tail meets the blocks walking forward met, reversed."""
    backward = []
    node = queue.fake_free_list_tail.prev_free_block
    while node is not None and node is not queue.fake_free_list_head:
        backward.append(node.block_id)
        node = node.prev_free_block
    return backward[::-1] == _ids(queue) and len(backward) == queue.num_free_blocks


def free_queue_prepend_n_keeps_order(
    initial: int, prepended: int
) -> tuple[FreeKVCacheBlockQueue, list[int]]:
    """impl: prepend_n puts the blocks at the front in the order given.

    pre: 0 <= initial <= 4
    pre: 0 <= prepended <= 3
    post: _ids(__return__[0]) == __return__[1]
    post: _linked_both_ways(__return__[0])
    """
    blocks = [KVCacheBlock(i) for i in range(initial + prepended)]
    queue = FreeKVCacheBlockQueue(blocks[:initial])
    queue.prepend_n(blocks[initial:])
    return queue, list(range(initial, initial + prepended)) + list(range(initial))


def free_queue_append_n_keeps_order(
    initial: int, appended: int
) -> tuple[FreeKVCacheBlockQueue, list[int]]:
    """impl: append_n puts the blocks at the back in the order given.

    pre: 0 <= initial <= 4
    pre: 0 <= appended <= 3
    post: _ids(__return__[0]) == __return__[1]
    post: _linked_both_ways(__return__[0])
    """
    blocks = [KVCacheBlock(i) for i in range(initial + appended)]
    queue = FreeKVCacheBlockQueue(blocks[:initial])
    queue.append_n(blocks[initial:])
    return queue, list(range(initial + appended))


def free_queue_remove_unlinks_one(
    size: int, position: int
) -> tuple[FreeKVCacheBlockQueue, list[int]]:
    """impl: remove takes exactly one block out, from anywhere, in O(1).

    pre: 1 <= size <= 5
    pre: 0 <= position < size
    post: _ids(__return__[0]) == __return__[1]
    post: _linked_both_ways(__return__[0])
    """
    blocks = [KVCacheBlock(i) for i in range(size)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[position])
    return queue, [i for i in range(size) if i != position]


def free_queue_popleft_n_takes_the_front(
    size: int, n: int
) -> tuple[FreeKVCacheBlockQueue, list[int], list[int]]:
    """impl: popleft_n hands out the n front blocks, front first.

    pre: 0 <= size <= 5
    pre: 0 <= n <= size
    post: __return__[1] == list(range(n))
    post: _ids(__return__[0]) == __return__[2]
    post: _linked_both_ways(__return__[0])
    """
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(size)])
    taken = [b.block_id for b in queue.popleft_n(n)]
    return queue, taken, list(range(n, size))


# --------------------------------------------------------------------------
# Pairs for ``crosshair diffbehavior``: one scenario, run on the model and on
# the impl, with plain results. CrossHair searches the integers for a run
# where the two answers differ.
# --------------------------------------------------------------------------


def scenario_on_model(num_blocks: int, held: int, cached: int, reuse: int) -> tuple[object, ...]:
    """Take ``held`` blocks, cache the first ``cached``, free them in reverse, take ``reuse``."""
    if not (1 <= num_blocks <= 6 and 0 <= held < num_blocks and 0 <= cached <= held):
        return ("invalid",)
    state = pool_with_held(num_blocks, held, cached)
    state, _ = model.free_blocks(state, list(range(held, 0, -1)))
    if not 0 <= reuse <= len(state.free_queue):
        return ("invalid",)
    state, taken = model.get_new_blocks(state, reuse)
    hits = tuple(model.get_cached_block(state, bytes([i + 1]), [0]) for i in range(cached))
    return taken, state.free_queue, hits


def scenario_on_impl(num_blocks: int, held: int, cached: int, reuse: int) -> tuple[object, ...]:
    """The same scenario as ``scenario_on_model``, on ``kvpool.impl.BlockPool``."""
    if not (1 <= num_blocks <= 6 and 0 <= held < num_blocks and 0 <= cached <= held):
        return ("invalid",)
    pool = BlockPool(num_blocks, True, 1)
    blocks = pool.get_new_blocks(held)
    hashes = tuple(bytes([i + 1]) for i in range(cached))
    pool.cache_full_blocks(CacheRequest(hashes), blocks, 0, cached, 1, 0)
    pool.free_blocks(list(reversed(blocks)))
    if not 0 <= reuse <= pool.get_num_free_blocks():
        return ("invalid",)
    taken = tuple(b.block_id for b in pool.get_new_blocks(reuse))
    queue = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    hits = []
    for i in range(cached):
        found = pool.get_cached_block(bytes([i + 1]), [0])
        hits.append(None if found is None else tuple(b.block_id for b in found))
    return taken, queue, tuple(hits)
