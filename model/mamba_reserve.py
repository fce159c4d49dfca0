"""Mamba "align" groups that reserve blocks: prefill checkpoints and speculative blocks.

vLLM 0.33.0's ``MambaSpec`` can ask an "align" group (``kvpool.model.mamba_align``)
for two kinds of block beyond the one state block a chunk ends in:

* a **prefill checkpoint** (``prefill_checkpoint_alignment`` > 0, which stands
  for vLLM's ``num_prefill_checkpoint_blocks > 0`` with an alignment): a chunk
  that spans at least two blocks past its start keeps, besides the block it ends
  in, a real block at the position of the last block boundary before its last
  token (the *checkpoint*), where a bare "align" group leaves a null. The worker
  exports the state there, so the boundary is cached like any full block and a
  later request resumes from it. The checkpoint is decided when the allocation
  is counted (``plan_checkpoint``) and remembered for the request until the next
  count: caching reads it to key the checkpoint block again if it lost its key;
* **speculative blocks** (``num_speculative_blocks`` S > 0, for drafts of
  MTP/EAGLE over linear attention): the table always reaches S blocks past the
  block the main model's tokens end in. At the next allocation those S blocks,
  when the chunk moved past them, are moved to the end of the table (nulls in
  their place) instead of taking fresh ones, and the running state is the block
  S before the end.

Only the geometry ``kvpool.model.mamba_align`` models (hash block = block =
scheduler block), dense retention, no EAGLE block drop and no hash look-ahead:
there the checkpoint is always a block boundary and its block's full-block key
is the checkpoint's key. Every function is pure. Source: vLLM 0.33.0,
``MambaManager._needs_internal_checkpoint``, ``get_num_blocks_to_allocate``,
``allocate_new_blocks``, ``_relocate_speculative_block`` and
``_cache_partial_tail_block`` in ``vllm/v1/core/single_type_kv_cache_manager.py``,
``get_mamba_prefill_checkpoint_position`` and ``is_mamba_prefill_checkpoint_valid``
in ``vllm/v1/kv_cache_interface.py``; docs/semantics.md, "Mamba in align mode:
checkpoint and speculative blocks".
"""

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpool.model.errors import InvalidBlockRange, InvalidManagerConfig
from kvpool.model.mamba_align import AlignTable
from kvpool.model.pool import cache_full_blocks, evict_blocks, get_new_blocks
from kvpool.model.state import NULL_BLOCK_ID, CacheRequest, PoolState

if TYPE_CHECKING:  # kvpool.model.single_type calls this module's functions
    from kvpool.model.single_type import KVCacheSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint_position(num_tokens: int, alignment: int, lookahead: int = 0) -> int:
    """The last multiple of ``alignment`` before token ``num_tokens`` that leaves
    ``max(1, lookahead)`` tokens after it (a resend recomputes the last token; the
    checkpoint's hash covers the pool's ``num_hash_lookahead_tokens``), 0 if none.
    vLLM 0.33.0's ``get_mamba_prefill_checkpoint_position`` without EAGLE.

    >>> checkpoint_position(9, 4), checkpoint_position(8, 4), checkpoint_position(1, 4)
    (8, 4, 0)
    >>> checkpoint_position(9, 4, 2)
    4
    """
    return max((num_tokens - max(1, lookahead)) // alignment * alignment, 0)


def checkpoint_valid(
    query_start: int,
    query_end: int,
    position: int,
    block_size: int,
    checkpoint_alignment: int,
    hash_block_size: int = 0,
) -> bool:
    """Whether a chunk ``query_start..query_end`` can export the state at ``position``.

    The chunk starts on a hash-block boundary, its checkpoint column (the block
    before the one it ends in) lies past the block its initial state comes from,
    the checkpoint is at least a hash block past the start and strictly inside
    the chunk, and a multiple of ``checkpoint_alignment`` tokens from the start.
    ``hash_block_size`` 0: the block's (caching on, kvpool's "align" geometry).

    >>> checkpoint_valid(0, 8, 4, 4, 4), checkpoint_valid(0, 4, 0, 4, 4)
    (True, False)
    """
    hbs = hash_block_size or block_size
    initial_column = (query_start - 1) // block_size
    column = _cdiv(query_end, block_size) - 2
    return (
        query_start % hbs == 0
        and column > initial_column
        and query_start + hbs <= position
        and query_start < position < query_end
        and (position - query_start) % checkpoint_alignment == 0
    )


def plan_checkpoint(
    table: AlignTable,
    block_size: int,
    num_speculative_blocks: int,
    checkpoint_alignment: int,
    request_id: str,
    held: Sequence[int],
    query_start: int,
    query_end: int,
    cache_alignment: int,
    hash_block_size: int = 0,
    lookahead: int = 0,
) -> AlignTable:
    """Record (or forget) the request's checkpoint for a chunk ``query_start..query_end``.

    ``held`` is the request's table before its hits are added. The checkpoint is
    the last multiple of ``cache_alignment`` before the chunk's last token, kept
    in the block before the one the chunk ends in, when the chunk can export it
    (``checkpoint_valid``) and that block is not a real one already: past the
    table, a null, or one of the speculative blocks of a request already
    allocated. ``checkpoint_alignment`` 0: the group has no checkpoint blocks.
    ``lookahead``: the pool's ``num_hash_lookahead_tokens`` (``checkpoint_position``).

    Complexity: O(1) besides copying the table's map.

    >>> plan_checkpoint(AlignTable(), 4, 0, 4, "r", (), 0, 8, 4).checkpoints
    {'r': (4, 0)}
    """
    position = checkpoint_position(query_end, cache_alignment, lookahead)
    index = _cdiv(query_end, block_size) - 2
    needed = (
        checkpoint_alignment > 0
        and checkpoint_valid(
            query_start, query_end, position, block_size, checkpoint_alignment, hash_block_size
        )
        and index >= 0
        and (
            index >= len(held)
            or held[index] == NULL_BLOCK_ID
            or (request_id in table.allocated and index >= len(held) - num_speculative_blocks)
        )
    )
    checkpoints = {r: c for r, c in table.checkpoints.items() if r != request_id}
    if needed:
        checkpoints[request_id] = (position, index)
    if checkpoints == table.checkpoints:
        return table
    return replace(table, checkpoints=checkpoints)


def num_blocks_to_allocate(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    num_speculative_blocks: int,
    request_id: str,
    held: Sequence[int],
    num_tokens: int,
    hits: Sequence[int],
) -> int:
    """``kvpool.model.mamba_align.num_blocks_to_allocate`` with reserved blocks.

    The table must reach ``num_speculative_blocks`` past the block the main model's
    ``num_tokens`` end in; what it lacks is at most one block, plus one for a
    recorded checkpoint, plus the speculative blocks on a request's first
    allocation (later ones move the old ones). A producer's pending state copy
    (``table.partial_hits``, blocks of several hash blocks: ``kvpool.model.mamba_fine``)
    takes one block more and raises the cap by one. Plus the free hits; a hit ending on
    a state cached this step asks for more than the pool has. Not clamped at zero.

    Complexity: O(len(hits)).

    >>> from kvpool.model.pool import new_pool
    >>> num_blocks_to_allocate(new_pool(8), AlignTable(), 2, 2, "r", (), 7, ())
    3
    """
    if hits:
        key = pool.blocks[hits[-1]].block_hash
        if key is not None and key in table.cached_this_step:
            return pool.config.num_blocks + 1
    lacking = _cdiv(num_tokens, block_size) + num_speculative_blocks - len(hits) - len(held)
    producer = int(request_id in table.partial_hits)
    if producer:
        lacking = max(lacking, 0) + 1
    if lacking > 0:
        cap = 1 + producer + int(request_id in table.checkpoints)
        if request_id not in table.allocated:
            cap += num_speculative_blocks
        lacking = min(lacking, cap)
    evictable = sum(1 for b in hits if b != NULL_BLOCK_ID and pool.blocks[b].ref_cnt == 0)
    return lacking + evictable


def allocate(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    num_speculative_blocks: int,
    request_id: str,
    blocks: tuple[int, ...],
    num_tokens: int,
) -> tuple[PoolState, AlignTable, tuple[int, ...], tuple[int, ...]]:
    """``kvpool.model.mamba_align.allocate`` with a checkpoint and speculative blocks.

    The table grows to ``num_speculative_blocks`` past the block ``num_tokens`` ends
    in: nulls over the skipped positions, except the recorded checkpoint's; a
    request allocated before moves its old speculative blocks that now lie before
    that (the checkpoint's position excepted) to the end, nulls in their place;
    fresh blocks fill the rest. A table long enough gains nothing unless a
    checkpoint is recorded. The running state until now (``last_state``) is the
    block ``num_speculative_blocks`` before the old end (the last hit for a
    request never allocated). Returns the pool, the table, the request's blocks and
    everything appended (nulls and moved blocks too).

    Complexity: O(positions appended).

    >>> from kvpool.model.pool import new_pool
    >>> allocate(new_pool(8), AlignTable(), 2, 1, "r", (), 7)[3]
    (0, 0, 0, 1, 2)
    """
    spec = num_speculative_blocks
    required = _cdiv(num_tokens, block_size) + spec
    checkpoint = int(request_id in table.checkpoints)
    allocated = table.allocated | {request_id}
    if required <= len(blocks) and not checkpoint:
        return pool, replace(table, allocated=allocated), blocks, ()
    prev = len(blocks)
    last_state = dict(table.last_state)
    if request_id in table.allocated:
        last_state[request_id] = prev - 1 - spec
    elif prev > 0:
        last_state[request_id] = prev - 1
    skipped = required - spec - 1
    row = list(blocks)
    row.extend([NULL_BLOCK_ID] * max(0, skipped - checkpoint - prev))
    if request_id in table.allocated:
        for i in range(max(prev - spec, 0), prev):
            if i >= skipped - checkpoint:
                break
            row.append(row[i])
            row[i] = NULL_BLOCK_ID
    pool, fresh = get_new_blocks(pool, max(required - len(row), 0))
    row.extend(fresh)
    table = replace(table, last_state=last_state, allocated=allocated)
    return pool, table, tuple(row), tuple(row[prev:])


def admission_blocks(
    pool: PoolState,
    table: AlignTable,
    spec: "KVCacheSpec",
    request_id: str,
    held: Sequence[int],
    num_tokens: int,
    hits: Sequence[int],
    query_start: int,
    cache_alignment: int,
) -> int:
    """The blocks a Mamba "align" group counts when the whole sequence must fit.

    vLLM 0.33.0 counts the group as for an allocation of ``num_tokens`` main-model
    tokens from ``query_start`` (``get_num_blocks_to_allocate`` with
    ``apply_admission_cap``): at most one block, plus a checkpoint's, plus the
    speculative blocks on a first allocation, plus the free hits, the pool's size
    plus one for a hit cached this step; the checkpoint is decided as for that chunk
    but not recorded. A bare "align" group is one reserving nothing.

    Complexity: O(len(hits)).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.single_type import mamba_align
    >>> admission_blocks(new_pool(8), AlignTable(), mamba_align(2), "r", (), 12, (), 0, 2)
    1
    """
    planned = plan_checkpoint(
        table,
        spec.block_size,
        spec.num_speculative_blocks,
        spec.prefill_checkpoint_alignment,
        request_id,
        held,
        query_start,
        num_tokens,
        checkpoint_alignment_of(pool, spec, cache_alignment),
        pool.config.hash_block_size,
        pool.config.num_hash_lookahead_tokens,
    )
    return num_blocks_to_allocate(
        pool,
        planned,
        spec.block_size,
        spec.num_speculative_blocks,
        request_id,
        held,
        num_tokens,
        hits,
    )


def checkpoint_alignment_of(pool: PoolState, spec: "KVCacheSpec", scheduler_block_size: int) -> int:
    """What a group's checkpoint position is a multiple of: vLLM 0.33.0's
    ``cache_hit_alignment_tokens`` (``HybridKVCacheCoordinator._cache_hit_alignment_tokens``
    in ``vllm/v1/core/kv_cache_coordinator.py``), the hash block when hits may end inside a
    Mamba block (caching on, a block of several hash blocks: ``kvpool.model.mamba_fine``),
    else the scheduler block (0: the group's block).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.single_type import mamba_reserving
    >>> checkpoint_alignment_of(new_pool(4, hash_block_size=2), mamba_reserving(8, 0, 2), 8)
    2
    """
    hbs = pool.config.hash_block_size
    if pool.config.enable_caching and spec.block_size > hbs:
        return hbs
    return scheduler_block_size or spec.block_size


def verify_checkpoint(table: AlignTable, request_id: str, blocks: Sequence[int]) -> None:
    """InvalidBlockRange if the request's recorded checkpoint lies past its table.

    It does when the allocation that recorded it was refused; caching then fails
    (vLLM 0.33.0 asserts in ``_cache_partial_tail_block``).

    >>> verify_checkpoint(AlignTable(checkpoints={"r": (4, 0)}), "r", (0,))
    """
    checkpoint = table.checkpoints.get(request_id)
    if checkpoint is not None and checkpoint[1] >= len(blocks):
        raise InvalidBlockRange(
            f"the checkpoint at block {checkpoint[1]} lies past the request's "
            f"{len(blocks)} blocks (its allocation was refused)"
        )


def cache_checkpoint(
    pool: PoolState,
    table: AlignTable,
    group: int,
    block_size: int,
    request: CacheRequest,
    request_id: str,
    blocks: Sequence[int],
) -> tuple[PoolState, AlignTable]:
    """Key the recorded checkpoint's block at the checkpoint, if it is not keyed there.

    In place of ``mamba_align.cache_prompt_boundary`` when a checkpoint is recorded.
    The checkpoint is the block's own boundary here, so its key is the block's
    full-block key: a block that lost it (or carries another) is keyed again, every
    other key of it removed first, and the key counts as cached this step. A null
    (the position was released since) changes nothing, as does a block keyed there.

    Complexity: O(keys of the block).

    >>> from kvpool.model.pool import new_pool
    >>> pool, ids = get_new_blocks(new_pool(4), 2)
    >>> table = AlignTable(checkpoints={"r": (1, 0)})
    >>> pool, table = cache_checkpoint(pool, table, 0, 1, CacheRequest((b"a",)), "r", ids)
    >>> pool.blocks[ids[0]].hash_num_tokens, len(table.cached_this_step)
    (1, 1)
    """
    position, index = table.checkpoints[request_id]
    if index >= len(blocks):
        return pool, table
    block = blocks[index]
    if block == NULL_BLOCK_ID or pool.blocks[block].hash_num_tokens == position:
        return pool, table
    if pool.blocks[block].block_hash is not None:
        pool, _ = evict_blocks(pool, [block])
    pool, _ = cache_full_blocks(pool, request, blocks, index, index + 1, block_size, group)
    key = pool.blocks[block].block_hash
    if key is not None:
        table = replace(table, cached_this_step=table.cached_this_step | {key})
    return pool, table


def verify_reserving(
    mamba_align: bool, num_speculative_blocks: int, checkpoint_alignment: int
) -> None:
    """InvalidManagerConfig unless the reserved blocks are counts a group can have.

    Both are non-negative ints, and only a Mamba "align" group reserves any.

    >>> verify_reserving(True, 1, 4)
    """
    for name, value in (
        ("num_speculative_blocks", num_speculative_blocks),
        ("prefill_checkpoint_alignment", checkpoint_alignment),
    ):
        # Verify that the count is a non-negative int
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidManagerConfig(f"{name}={value!r} must be a non-negative int")
        # Verify that only a Mamba "align" group reserves blocks
        if value and not mamba_align:
            raise InvalidManagerConfig(f'{name}={value}: only Mamba "align" groups reserve blocks')


def verify_reserving_geometry(
    specs: "Sequence[KVCacheSpec]", hash_block_size: int, scheduler_block_size: int
) -> None:
    """InvalidManagerConfig unless every group reserving blocks has blocks as large as the
    scheduler block and, with prefix caching, one hash block (the only geometry modelled:
    elsewhere vLLM places the checkpoint on a hash or scheduler boundary inside a block,
    keyed as a partial block). ``hash_block_size`` 0: caching is off.

    >>> from kvpool.model.single_type import mamba_reserving
    >>> verify_reserving_geometry([mamba_reserving(4, 1)], 4, 4)
    """
    for spec in specs:
        if not (spec.num_speculative_blocks or spec.prefill_checkpoint_alignment):
            continue
        # Verify that the group's block is the scheduler's block, and one hash block if cached
        if spec.block_size != scheduler_block_size or (
            hash_block_size and spec.block_size != hash_block_size
        ):
            raise InvalidManagerConfig(
                f'Mamba "align" with reserved blocks in blocks of {spec.block_size} tokens, hash '
                f"blocks of {hash_block_size} and scheduler blocks of {scheduler_block_size} is "
                "not modelled (all three equal only)"
            )
