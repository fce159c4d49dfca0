"""Prefill checkpoints in a Mamba "align" group whose hits may end inside a block (vLLM 0.33).

With blocks of several hash blocks (``kvpool.model.mamba_fine``) a prefill checkpoint
(``kvpool.model.mamba_reserve``) sits on a *hash-block* boundary: the last one before the
chunk's end that leaves ``max(1, num_hash_lookahead_tokens)`` tokens after it
(``mamba_reserve.checkpoint_position`` with the hash block as alignment). The worker
exports the state there into the block before the one the chunk ends in, so that block
holds a state that usually lies past its own column, inside the next. The checkpoint is
counted, recorded and allocated as with blocks of one hash block (plus a producer's copy:
``mamba_reserve.num_blocks_to_allocate``, ``mamba_fine.allocate``); caching differs, and
is this module's ``cache_checkpoint``:

* the prompt's checkpoint (the one its whole prompt would have), one on a block boundary,
  and one at the request's ``shared_prefix_boundary`` are kept: the block's keys are
  replaced by the checkpoint's key (a partial key when inside a block);
* any other checkpoint (a middle chunk's, inside a block) is transient: the worker
  overwrites it, so the block loses every key, the full-block key it may have taken in
  this very call included.

A recorded checkpoint replaces the prompt's partial-tail step (``mamba_fine.cache_partial_tail``):
the request never becomes a producer in that call. Speculative blocks are allocated as with
blocks of one hash block, beside the copies (``mamba_fine.allocate``). Source: vLLM 0.33.0,
``MambaManager._cache_partial_tail_block`` in ``vllm/v1/core/single_type_kv_cache_manager.py``,
``BlockPool.cache_partial_block`` (``replace_existing_hashes``) and
``_maybe_evict_cached_block`` in ``vllm/v1/core/block_pool.py``; docs/semantics.md,
"Mamba in align mode: checkpoints with hits inside a Mamba block".
"""

from collections.abc import Sequence
from dataclasses import replace

from kvpool.model.mamba_align import AlignTable
from kvpool.model.mamba_reserve import checkpoint_position
from kvpool.model.pool import cache_partial_block, evict_blocks
from kvpool.model.state import NULL_BLOCK_ID, CacheRequest, PoolState


def kept(
    position: int,
    block_size: int,
    hash_block_size: int,
    num_prompt_tokens: int,
    lookahead: int,
    shared_prefix_boundary: int,
) -> bool:
    """Whether a checkpoint at ``position`` is reusable: the prompt's own checkpoint, on a
    block boundary (dense retention keeps every one), or at the request's shared-prefix
    boundary.

    >>> kept(1088, 512, 64, 1089, 0, 0), kept(960, 512, 64, 1089, 0, 0)
    (True, False)
    >>> kept(1024, 512, 64, 1089, 0, 0)
    True
    """
    prompt = checkpoint_position(num_prompt_tokens, hash_block_size, lookahead)
    return position in (prompt, shared_prefix_boundary) or position % block_size == 0


def cache_checkpoint(
    pool: PoolState,
    table: AlignTable,
    group: int,
    block_size: int,
    request: CacheRequest,
    request_id: str,
    blocks: Sequence[int],
    num_prompt_tokens: int,
    shared_prefix_boundary: int,
) -> tuple[PoolState, AlignTable]:
    """Key the recorded checkpoint's block at the checkpoint, or drop its keys.

    A checkpoint that is not ``kept`` is transient: its block (unless null) loses every
    key, and nothing is keyed. A kept one keys its block at the checkpoint unless the
    block is keyed there already: every key of the block is removed first (one removal
    event each) and the checkpoint's key, a partial key inside a block, becomes its only
    one and counts as cached this step. The recorded checkpoint lies in ``blocks``
    (``mamba_reserve.verify_checkpoint``).

    Complexity: O(keys of the block).

    >>> from kvpool.model.pool import get_new_blocks, new_pool
    >>> pool, ids = get_new_blocks(new_pool(4, hash_block_size=2), 2)
    >>> table = AlignTable(checkpoints={"r": (6, 0)})
    >>> pool, table = cache_checkpoint(
    ...     pool, table, 0, 4, CacheRequest((b"a", b"b", b"c")), "r", ids, 7, 0)
    >>> pool.blocks[ids[0]].hash_num_tokens, len(table.cached_this_step)
    (6, 1)
    """
    config = pool.config
    hbs = config.hash_block_size
    position, index = table.checkpoints[request_id]
    block = blocks[index]
    lookahead = config.num_hash_lookahead_tokens
    if not kept(position, block_size, hbs, num_prompt_tokens, lookahead, shared_prefix_boundary):
        # the worker overwrites this state: neither it nor a key taken this step is reusable
        if block != NULL_BLOCK_ID and pool.blocks[block].block_hash is not None:
            pool, _ = evict_blocks(pool, [block])
        return pool, table
    if block == NULL_BLOCK_ID or pool.blocks[block].hash_num_tokens == position:
        return pool, table
    # kvpool's cache_partial_block refuses a block boundary and reads the block size only
    # for that check: a block one hash block longer than the boundary gives vLLM's key
    size = block_size if position % block_size else position + hbs
    pool, key = cache_partial_block(
        pool, request, block, position, group, size, replace_existing_hashes=True
    )
    if key is not None:
        table = replace(table, cached_this_step=table.cached_this_step | {key})
    return pool, table
