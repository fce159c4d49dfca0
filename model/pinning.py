"""Keeping a released block readable, and moving a block's keys: vLLM 0.33's additions.

Three operations of the v1 block pool that vLLM 0.33.0 added
(``vllm/v1/core/block_pool.py``, docs/semantics.md "Pinning and relocation"):

* ``unpin_blocks`` releases references like ``free_blocks`` but the caller
  keeps *reading* the blocks until the pool reuses them: they join the back
  of the free queue (last to be handed out) and a watcher is registered that
  fires once, when ``get_new_blocks`` hands the block out or a reset forgets
  every key. "Pinned" is not a flag: a block is pinned while it is held.
* ``move_block_hashes`` re-points every key of one block to another (a private
  copy that now holds the same contents), with no event: the hash is still
  stored, in another block.
* ``is_block_writable``: held exactly once and carrying no key, so no other
  request can be reading it.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from kvpool.model.errors import AlreadyCached, BlockNotHeld, InvalidArgument, OverFree
from kvpool.model.pool import _id_list, _set_block, _verify_known
from kvpool.model.state import NULL_BLOCK_ID, HashKey, PoolState, Watcher


def unpin_blocks(
    state: PoolState, block_ids: Sequence[int], watcher: Watcher
) -> tuple[PoolState, None]:
    """Release one reference per listed block; tell ``watcher`` when a block is reused.

    Per listed block, in order: its count drops by one and ``watcher`` is
    registered for it (replacing an earlier watcher of that block, which
    keeps its place in the registration order), even if the count stays
    above zero. The blocks that reach zero join the *back* of the free queue
    in listed order, hashed or not, whatever the profile: the last to be
    reused. No event is emitted.

    Complexity: O(len(block_ids)).

    >>> from kvpool.model.pool import get_new_blocks, new_pool
    >>> pool, ids = get_new_blocks(new_pool(4), 2)
    >>> pool, _ = unpin_blocks(pool, [1], "reader")
    >>> pool.free_queue, dict(pool.watchers)
    ((3, 1), {1: 'reader'})
    """
    # Verify that the ids are a sequence
    block_ids = _id_list(block_ids)
    # Verify that every id names a block of the pool
    _verify_known(state, block_ids)
    # Verify that the watcher can be recorded (it is hashable)
    try:
        hash(watcher)
    except TypeError:
        raise InvalidArgument(f"a watcher must be hashable, got {type(watcher).__name__}") from None
    # Verify that no block is released more times than it is held (the null block never is)
    for block_id, count in Counter(block_ids).items():
        held = state.blocks[block_id].ref_cnt
        if held == 0:
            raise BlockNotHeld(f"block {block_id} is not held: it cannot be unpinned")
        if count > held:
            raise OverFree(f"block {block_id} is held {held} time(s) but unpinned {count} times")

    watchers = dict(state.watchers)
    newly_free: list[int] = []
    for block_id in block_ids:
        ref_cnt = state.blocks[block_id].ref_cnt - 1
        state = _set_block(state, block_id, ref_cnt=ref_cnt)
        watchers[block_id] = watcher
        if ref_cnt == 0:
            newly_free.append(block_id)
    return replace(state, free_queue=state.free_queue + tuple(newly_free), watchers=watchers), None


def move_block_hashes(state: PoolState, src: int, dst: int) -> tuple[PoolState, None]:
    """Re-point every key of ``src`` to ``dst``, which takes over ``src``'s place in the cache.

    ``src``'s primary key becomes ``dst``'s, with its token count, and its
    partial keys follow in order; ``src`` ends with no key. Under each key
    ``dst`` is listed *last*, so a block that shared the key and was listed
    after ``src`` is now the one a lookup finds. No event is emitted and no
    count or queue position changes. ``src`` without keys: nothing happens.

    Complexity: O(number of keys ``src`` carries).

    >>> from kvpool.model.pool import cache_full_blocks, get_new_blocks, new_pool
    >>> from kvpool.model.state import CacheRequest
    >>> pool, ids = get_new_blocks(new_pool(4), 2)
    >>> pool, _ = cache_full_blocks(pool, CacheRequest((b"a",)), [1], 0, 1, 1, 0)
    >>> pool, _ = move_block_hashes(pool, 1, 2)
    >>> dict(pool.cached), pool.blocks[1].block_hash
    ({(b'a', 0): (2,)}, None)
    """
    # Verify that both ids name blocks of the pool
    _verify_known(state, [src, dst])
    # Verify that the destination is held (so neither free nor the null block)
    if state.blocks[dst].ref_cnt == 0:
        raise BlockNotHeld(f"block {dst} is not held: keys can only move to a held block")
    # Verify that the destination carries no key yet
    if state.blocks[dst].block_hash is not None:
        raise AlreadyCached(f"block {dst} already carries a key")

    source = state.blocks[src]
    keys: tuple[HashKey, ...] = source.hash_keys()
    if not keys:
        return state, None
    cached = dict(state.cached)
    for key in keys:
        cached[key] = (*(b for b in cached[key] if b != src), dst)
    state = _set_block(state, src, block_hash=None, hash_num_tokens=None, partial_keys=())
    state = _set_block(
        state,
        dst,
        block_hash=keys[0],
        hash_num_tokens=source.hash_num_tokens,
        partial_keys=keys[1:],
    )
    return replace(state, cached=cached), None


def is_block_writable(state: PoolState, block_id: int) -> bool:
    """Whether a request may write the block in place: held once, no key, not the null block.

    Complexity: O(1).

    >>> from kvpool.model.pool import get_new_blocks, new_pool
    >>> pool, _ = get_new_blocks(new_pool(3), 1)
    >>> is_block_writable(pool, 1), is_block_writable(pool, 2)
    (True, False)
    """
    # Verify that the id names a block of the pool
    _verify_known(state, [block_id])
    block = state.blocks[block_id]
    return block_id != NULL_BLOCK_ID and block.ref_cnt == 1 and block.block_hash is None
