"""Mamba "align" blocks of several hash blocks: hits that end inside a Mamba block (vLLM 0.33).

When a Mamba "align" block holds several hash blocks (hash 16 in blocks of
544, say), vLLM 0.33.0 turns fine-grained hits on for the whole manager
(``partial_hash_hits_enabled``): a hit may end on any hash-block boundary.
For a Mamba group that needs a state at that boundary, and a Mamba block
holds one state only, the one after its last computed token. So:

* a hit is searched hash block by hash block from the right (``find_hit``):
  the block holding the state is the hit's last block, nulls before it;
* when a chunk ends exactly on the prompt's partial boundary (the last
  hash-block boundary that leaves ``max(1, lookahead)`` tokens after it,
  ``partial_boundary``), the block the chunk ends in is keyed there as a
  partial key (``cache_partial_tail``); the request is then a *producer*:
  its next allocation writes on into that block, so the state is first
  copied to a fresh block that takes over the keys (``allocate``);
* a request hitting a state inside a block (a *consumer*) gets a private
  copy of it where the hit ends, so its own tokens never overwrite the
  shared state (``allocate``, with the hit).

Each copy is a (source, destination) pair the scheduler takes with
``take_kv_cache_block_copies``; each end holds one extra reference until
then. A producer's copy is also offered to a connector with the boundary's
tokens, and a producer that finishes before its next allocation hands the
state where it is (``finalize``).

What is modelled: prefill checkpoint and speculative blocks in the Mamba group
(``kvpool.model.mamba_fine_reserve``), every other group full attention (of any
block size), no EAGLE, no sparse retention (``kvpool.model.mamba_fine_config``).
Source: vLLM 0.33.0,
``MambaManager`` (``find_longest_cache_hit``, ``get_num_blocks_to_allocate``,
``allocate_new_blocks``, ``_cache_partial_tail_block``,
``finalize_partial_tail_offload``, ``pop_blocks_for_free``) in
``vllm/v1/core/single_type_kv_cache_manager.py``; docs/semantics.md,
"Mamba align: hits inside a Mamba block".
"""

from collections.abc import Sequence
from dataclasses import replace

from kvpool.model.errors import InvalidTokenCount
from kvpool.model.mamba_align import AlignTable
from kvpool.model.mamba_align import allocate as allocate_whole
from kvpool.model.mamba_align import num_blocks_to_allocate as blocks_to_allocate_whole
from kvpool.model.mamba_reserve import allocate as allocate_reserving
from kvpool.model.pinning import move_block_hashes
from kvpool.model.pool import (
    cache_partial_block,
    get_cached_block,
    get_new_blocks,
    touch,
)
from kvpool.model.state import NULL_BLOCK_ID, BlockHash, CacheRequest, PoolState

Copy = tuple[int, int]
"""A state copy: (source block, destination block)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def partial_boundary(num_prompt_tokens: int, hash_block_size: int, lookahead: int) -> int:
    """The prompt's last hash-block boundary a resend can hit: ``max(1, lookahead)`` tokens
    stay after it (the last token for its logits; the look-ahead tokens the boundary's hash
    covers). vLLM 0.33.0's ``get_mamba_prefill_checkpoint_position`` without EAGLE.

    >>> partial_boundary(1249, 16, 0), partial_boundary(1249, 16, 2)
    (1248, 1232)
    """
    return max((num_prompt_tokens - max(1, lookahead)) // hash_block_size * hash_block_size, 0)


def find_hit(
    pool: PoolState,
    block_size: int,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """The last hash-block boundary within ``max_length`` whose state every group has cached.

    ``block_hashes`` are the request's, one per hash block. Returns one tuple
    per group (nulls up to the block holding the state, then that block) and
    the hit's length in tokens; all empty and 0 when no boundary is cached.
    A whole block's key is its last hash block's, so whole blocks are found
    the same way.

    Complexity: O(max_length / hash_block_size * len(group_ids)).

    >>> from kvpool.model.pool import new_pool
    >>> find_hit(new_pool(4, hash_block_size=2), 4, [b"a", b"b"], 4, [0])
    (((),), 0)
    """
    # Verify that the length is not negative
    if max_length < 0:
        raise InvalidTokenCount(f"max_length={max_length} is negative")
    hbs = pool.config.hash_block_size
    scale = block_size // hbs
    for fine in range(min(max_length // hbs, len(block_hashes)) - 1, -1, -1):
        found = get_cached_block(pool, block_hashes[fine], group_ids)
        if found is not None:
            index = fine // scale
            return tuple((NULL_BLOCK_ID,) * index + (b,) for b in found), (fine + 1) * hbs
    return tuple(() for _ in group_ids), 0


def num_blocks_to_allocate(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    request_id: str,
    held: Sequence[int],
    num_tokens: int,
    hits: Sequence[int],
) -> int:
    """Free blocks an allocation takes in the group, a producer's pending copy included.

    As ``kvpool.model.mamba_align.num_blocks_to_allocate``; a request with a
    pending producer copy (``table.partial_hits``) takes one block for it and
    at most one more. A consumer's copy is counted by the manager (one per
    hit ending inside a block).

    Complexity: O(len(hits)).

    >>> from kvpool.model.pool import new_pool
    >>> num_blocks_to_allocate(new_pool(8), AlignTable(partial_hits={"r": (0, 1)}), 4, "r",
    ...     (1,), 3, ())
    1
    """
    if request_id not in table.partial_hits:
        return blocks_to_allocate_whole(pool, table, block_size, held, num_tokens, hits)
    lacking = _cdiv(num_tokens, block_size) - len(hits) - len(held)
    return min(max(lacking, 0), 1) + 1


def allocate(
    pool: PoolState,
    table: AlignTable,
    group: int,
    block_size: int,
    request_id: str,
    blocks: tuple[int, ...],
    num_tokens: int,
    hit: tuple[int, int] | None = None,
    num_speculative_blocks: int = 0,
) -> tuple[PoolState, AlignTable, tuple[int, ...], tuple[int, ...], Copy | None]:
    """Extend the request's table for ``num_tokens`` tokens, copying a state a hit ends inside.

    ``hit`` is a consumer's (block index, source block): the hit ends inside
    that block. Without one, a producer's pending copy (``table.partial_hits``)
    is taken; with neither this is ``kvpool.model.mamba_align.allocate``.
    With a copy: the previous state's position is remembered, nulls fill the
    skipped positions (but a recorded checkpoint's, ``table.checkpoints``), and the
    copy's destination is taken first, then the checkpoint's block if recorded and at
    most one block where the chunk ends, then ``num_speculative_blocks`` (a running
    request first moves its old speculative blocks the chunk passed to the end, as
    ``kvpool.model.mamba_reserve.allocate``, which is the whole of it without a copy
    when a checkpoint is recorded or speculative blocks are kept). A consumer's destination replaces
    the source in its table (and is returned first); a producer keeps writing
    into the source, so the source's keys move to the destination, which is
    offered to a connector with the boundary's tokens (if the producer's tail
    is still recorded) and counts as cached this step.

    Returns the pool, the table, the request's blocks, what the worker's
    table gains, and the copy (None without one).

    Complexity: O(positions appended + keys moved).

    >>> from kvpool.model.pool import new_pool
    >>> pool, held = get_new_blocks(new_pool(8, hash_block_size=2), 1)
    >>> allocate(pool, AlignTable(), 0, 4, "r", held, 7, (0, held[0]))[3:]
    ((2, 3), (1, 2))
    """
    if hit is None:
        hit = table.partial_hits.get(request_id)
    # a recorded prefill checkpoint keeps a real block before the one the chunk ends in,
    # speculative blocks follow it (kvpool.model.mamba_fine_reserve)
    checkpoint = int(request_id in table.checkpoints)
    spec = num_speculative_blocks
    if hit is None:
        if checkpoint or spec:
            pool, table, blocks, new = allocate_reserving(
                pool, table, block_size, spec, request_id, blocks, num_tokens
            )
            return pool, table, blocks, new, None
        pool, table, blocks, new = allocate_whole(
            pool, table, block_size, request_id, blocks, num_tokens
        )
        return pool, table, blocks, new, None
    index, source = hit
    running = request_id in table.allocated
    last_state = dict(table.last_state)
    prev = len(blocks)
    if running:
        last_state[request_id] = prev - 1 - spec
    elif blocks:
        last_state[request_id] = prev - 1
    required = _cdiv(num_tokens, block_size) + spec
    stop = required - spec - 1 - checkpoint
    row = list(blocks)
    if prev < stop:
        row.extend([NULL_BLOCK_ID] * (stop - prev))
    if running:
        # the old speculative blocks the chunk moved past go to the end (mamba_reserve.allocate)
        for i in range(max(prev - spec, 0), prev):
            if i >= stop:
                break
            row.append(row[i])
            row[i] = NULL_BLOCK_ID
    pool, fresh = get_new_blocks(pool, max(required - len(row), 0) + 1)
    destination, rest = fresh[0], fresh[1:]
    returned = tuple(row[prev:])
    tails = dict(table.producer_tails)
    offloads = table.offloads
    cached_this_step = table.cached_this_step
    if running:
        # the producer keeps its block: the cache entry moves to the copy
        pool, _ = move_block_hashes(pool, source, destination)
        pool, _ = touch(pool, [source])
        tail = tails.pop(request_id, None)
        if tail is not None:
            offloads = (*offloads, (request_id, group, destination, tail[1]))
        key = pool.blocks[destination].block_hash
        if key is not None:
            cached_this_step = cached_this_step | {key}
    else:
        row[index] = destination
        pool, _ = touch(pool, [destination])
        returned = (destination, *returned)
    row.extend(rest)
    table = replace(
        table,
        last_state=last_state,
        allocated=table.allocated | {request_id},
        partial_hits={r: h for r, h in table.partial_hits.items() if r != request_id},
        producer_tails=tails,
        offloads=offloads,
        cached_this_step=cached_this_step,
    )
    return pool, table, tuple(row), returned + rest, (source, destination)


def cache_partial_tail(
    pool: PoolState,
    table: AlignTable,
    group: int,
    block_size: int,
    request: CacheRequest,
    request_id: str,
    num_prompt_tokens: int,
    blocks: Sequence[int],
    num_tokens: int,
) -> tuple[PoolState, AlignTable, int | None]:
    """Key the state where caching reaches the prompt's partial boundary, inside its block.

    Only when ``num_tokens`` is that boundary (``partial_boundary``), its block
    is in the table, not null, and not keyed there already. Inside a block the
    key is a partial key (``cache_partial_block``), the request becomes a
    producer (its next allocation copies the state: ``table.partial_hits``,
    ``table.producer_tails``) and only the blocks before count as cached (the
    third value: the request's new cached count). On a block boundary the
    block is keyed again if it lost its key, as with blocks of one hash
    block, as vLLM does (a key of one hash block). The key counts as cached this step.

    Complexity: O(keys of the block).

    >>> from kvpool.model.pool import new_pool
    >>> cache_partial_tail(new_pool(4, hash_block_size=2), AlignTable(), 0, 4,
    ...     CacheRequest((b"a",)), "r", 5, (0,), 3)[2] is None
    True
    """
    config = pool.config
    hbs = config.hash_block_size
    boundary = partial_boundary(num_prompt_tokens, hbs, config.num_hash_lookahead_tokens)
    index = _cdiv(num_tokens, block_size) - 1
    if num_tokens <= 0 or num_tokens != boundary or index >= len(blocks):
        return pool, table, None
    source = blocks[index]
    if source == NULL_BLOCK_ID or pool.blocks[source].hash_num_tokens == num_tokens:
        return pool, table, None
    # vLLM keys the boundary with cache_partial_block even on a block boundary (a block that
    # lost its key): one key of one hash block, with that event. kvpool's cache_partial_block
    # refuses a block boundary, and reads the block size only for that check: a block one
    # hash block longer than the boundary gives vLLM's key and event.
    size = block_size if num_tokens % block_size else num_tokens + hbs
    pool, found = cache_partial_block(pool, request, source, num_tokens, group, size)
    if found is None:
        return pool, table, None
    if num_tokens % block_size == 0:
        return pool, replace(table, cached_this_step=table.cached_this_step | {found}), None
    table = replace(
        table,
        cached_this_step=table.cached_this_step | {found},
        partial_hits={**table.partial_hits, request_id: (index, source)},
        producer_tails={**table.producer_tails, request_id: (source, num_tokens)},
    )
    return pool, table, index


def finalize(
    table: AlignTable, group: int, request_id: str, num_computed_tokens: int, in_flight: int
) -> tuple[AlignTable, tuple[int, int, int] | None]:
    """A finishing producer's tail, consumed: (group, block, boundary tokens) when no token
    past the boundary was computed or is in flight, else None (consumed all the same).

    >>> finalize(AlignTable(producer_tails={"r": (3, 8)}), 1, "r", 8, 0)[1]
    (1, 3, 8)
    """
    tail = table.producer_tails.get(request_id)
    if tail is None:
        return table, None
    table = replace(
        table, producer_tails={r: t for r, t in table.producer_tails.items() if r != request_id}
    )
    source, boundary = tail
    if in_flight != 0 or num_computed_tokens != boundary:
        return table, None
    return table, (group, source, boundary)
