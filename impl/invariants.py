"""The fast pool's representation invariants, checked on demand.

These are the impl's own structural invariants (pointers, counters, the two
directions of the hash map); the model's semantic invariants live in
kvpool.specs. ``check_pool`` raises AssertionError naming the broken
invariant, followed by a dump of the whole pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.impl.block import KVCacheBlock

if TYPE_CHECKING:
    from kvpool.impl.pool import BlockPool


def check_pool(pool: BlockPool) -> None:
    """Assert every invariant of ``pool``; on failure the message ends with a state dump.

    Complexity: O(N + number of cached keys).
    """
    try:
        _check(pool)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump_pool(pool)}") from None


def _check(pool: BlockPool) -> None:
    blocks = pool.blocks
    n = pool.num_gpu_blocks
    queue = pool.free_block_queue
    head = queue.fake_free_list_head
    tail = queue.fake_free_list_tail

    # Every block sits at the index of its own id, and there are num_gpu_blocks of them.
    assert len(blocks) == n, f"{len(blocks)} blocks for num_gpu_blocks={n}"
    for i, block in enumerate(blocks):
        assert type(block) is KVCacheBlock, f"blocks[{i}] is a {type(block).__name__}"
        assert block.block_id == i, f"blocks[{i}] has block_id {block.block_id}"
        # Every block names this pool as its owner (that is how calls recognise them).
        assert block.pool is pool, f"blocks[{i}] belongs to {block.pool!r}"

    # The null block is block 0, flagged is_null, and the only block so flagged.
    assert pool.null_block is blocks[0], "null_block is not blocks[0]"
    for block in blocks:
        assert block.is_null == (block is pool.null_block), f"block {block.block_id}: is_null"

    # The sentinels have id -1, are no block of the pool, and end the list on both sides.
    for name, sentinel in (("head", head), ("tail", tail)):
        assert sentinel.block_id == -1, f"fake {name} has block_id {sentinel.block_id}"
        assert sentinel.ref_cnt == 0, f"fake {name} has ref_cnt {sentinel.ref_cnt}"
        assert sentinel.pool is None, f"fake {name} claims to belong to a pool"
        assert sentinel._block_hash is None, f"fake {name} carries a hash"
    assert head is not tail, "fake head and fake tail are one block"
    assert head.prev_free_block is None, "something precedes the fake head"
    assert tail.next_free_block is None, "something follows the fake tail"

    # Walking next from the head reaches the tail in at most N-1 steps: no cycle, no gap.
    order: list[KVCacheBlock] = []
    node = head.next_free_block
    while node is not tail:
        assert node is not None, f"the list breaks off after {_id(order[-1] if order else head)}"
        assert len(order) < n - 1, "the free list is longer than the pool (a cycle)"
        order.append(node)
        node = node.next_free_block
    # Links are symmetric: each node's prev is the node whose next it is, up to the tail.
    prev = head
    for node in [*order, tail]:
        assert node.prev_free_block is prev, (
            f"block {node.block_id}: prev_free_block is not block {prev.block_id}"
        )
        prev = node
    # Every listed block is a non-null block of this pool (none is listed twice: the
    # walk above would have run into a cycle).
    listed: set[int] = set()
    for node in order:
        assert 0 <= node.block_id < n and blocks[node.block_id] is node, (
            f"listed block {node.block_id} does not belong to the pool"
        )
        assert node is not pool.null_block, "the null block is in the free list"
        listed.add(node.block_id)

    # num_free_blocks is the length of the list.
    assert queue.num_free_blocks == len(listed), (
        f"num_free_blocks={queue.num_free_blocks} but the list holds {len(listed)}"
    )

    for block in blocks:
        bid = block.block_id
        # No ref count is negative; the null block's is always 0.
        assert block.ref_cnt >= 0, f"block {bid} has ref_cnt {block.ref_cnt}"
        assert not block.is_null or block.ref_cnt == 0, "the null block is held"
        # A block is in the list exactly when it is a non-null block with ref_cnt 0.
        should_list = block.ref_cnt == 0 and not block.is_null
        assert (bid in listed) == should_list, (
            f"block {bid} (ref_cnt {block.ref_cnt}) is {'' if bid in listed else 'not '}listed"
        )
        # (A held block's own links may be stale: nothing reads them.)

    cached = pool._cached
    # Without prefix caching nothing is ever cached.
    if not pool.enable_caching:
        assert not cached, "a pool without prefix caching has cached keys"

    for block in blocks:
        bid = block.block_id
        key = block._block_hash
        extra = block._extra_keys
        # A block has a primary key exactly when it has a token count for it.
        assert (key is None) == (block._block_hash_num_tokens is None), (
            f"block {bid}: primary key and token count disagree"
        )
        # Extra keys exist only beside a primary key, never empty, none repeated.
        if extra is not None:
            assert key is not None, f"block {bid} has extra keys but no primary key"
            assert extra, f"block {bid} has an empty extra-key list"
        keys = ([] if key is None else [key]) + (extra or [])
        assert len(set(keys)) == len(keys), f"block {bid} records a key twice: {keys}"
        # The null block is never cached.
        assert not (block.is_null and keys), "the null block carries a hash"
        # Every key a block records maps to an entry that holds that block.
        for k in keys:
            entry = cached.get(k)
            holds = entry is block or (isinstance(entry, dict) and entry.get(bid) is block)
            assert holds, f"block {bid} records key {k!r} but the map does not point back"

    # Together with the loop above, the map and the blocks' own keys are one relation.
    for k, entry in cached.items():
        # A map entry is a pool block, or a dict of two or more pool blocks keyed by id,
        # and each of those blocks records the key (the map points only at true owners).
        members = list(entry.items()) if isinstance(entry, dict) else [(entry.block_id, entry)]
        if isinstance(entry, dict):
            assert len(entry) >= 2, f"key {k!r} maps to a dict of {len(entry)} block(s)"
        for bid, block in members:
            assert 0 <= bid < n and blocks[bid] is block and block.block_id == bid, (
                f"key {k!r} maps to block {bid}, which is not this pool's block {bid}"
            )
            assert block._block_hash == k or (block._extra_keys and k in block._extra_keys), (
                f"key {k!r} maps to block {bid}, which does not record it"
            )

    # Without events enabled, no event is ever queued.
    if not pool.enable_kv_cache_events:
        assert not pool.kv_event_queue, "events queued on a pool without events"


def dump_pool(pool: BlockPool) -> str:
    """A readable dump of the whole pool: config, every block, the list, the map, events."""
    queue = pool.free_block_queue
    lines = [
        f"BlockPool(num_gpu_blocks={pool.num_gpu_blocks}, enable_caching={pool.enable_caching}, "
        f"hash_block_size={pool.hash_block_size}, "
        f"enable_kv_cache_events={pool.enable_kv_cache_events}, profile={pool.profile.name})",
        f"  num_free_blocks={queue.num_free_blocks}",
        f"  fake head: next={_id(queue.fake_free_list_head.next_free_block)}, "
        f"prev={_id(queue.fake_free_list_head.prev_free_block)}",
        f"  fake tail: prev={_id(queue.fake_free_list_tail.prev_free_block)}, "
        f"next={_id(queue.fake_free_list_tail.next_free_block)}",
    ]
    order: list[str] = []
    node = queue.fake_free_list_head.next_free_block
    for _ in range(pool.num_gpu_blocks + 1):
        if node is None or node is queue.fake_free_list_tail:
            break
        order.append(str(node.block_id))
        node = node.next_free_block
    else:
        order.append("...")
    lines.append(f"  free list (front first, bounded walk): [{', '.join(order)}]")
    lines.append("  blocks:")
    lines.extend(f"    {block!r}" for block in pool.blocks)
    lines.append("  hash map:")
    for key, entry in pool._cached.items():
        ids = list(entry) if isinstance(entry, dict) else entry.block_id
        lines.append(f"    {key!r} -> {ids}")
    lines.append(f"  pending events: {len(pool.kv_event_queue)}")
    return "\n".join(lines)


def _id(block: KVCacheBlock | None) -> str:
    return "None" if block is None else str(block.block_id)
