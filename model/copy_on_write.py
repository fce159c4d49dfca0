"""Fine-grained (partial-block) cache hits and the copy-on-write they need (vLLM 0.33).

When a group's block holds several hash blocks, a hit may end inside a
block: the prompt of an earlier request ended there, and its last hash
block was registered as a *partial* key of that block (the prompt's tail,
``kvpool.model.single_type.cache_blocks``). A later request hitting it
must not write into the shared block (its next tokens would overwrite the
other request's), so
``allocate_slots`` gives it a private block and records a copy of the
source into it (``kvpool.model.manager``). The scheduler takes the copies
once per step (``take_kv_cache_block_copies``), the GPU runs them before
the forward pass, and the scheduler then releases the extra reference
each end of a copy held meanwhile.

vLLM turns the lookup on only in a hybrid coordinator with a Mamba
"align" group (vllm/v1/core/kv_cache_utils.py, ``partial_hash_hits_enabled``,
vLLM 0.33.0), and off again when any prefix-cacheable group's manager
needs block-aligned lookups (vllm#51843). Beside a Mamba "align" group of
several hash blocks kvpool turns it on as vLLM does (``kvpool.model.mamba_fine_config``);
elsewhere the lookup is a switch of the manager, with the rule of vllm#51843
kept: every group must be full attention (``fine_grained_hits_enabled``).
docs/semantics.md, "Fine-grained hits and copy-on-write", records the
decisions.
"""

from collections.abc import Sequence

import kvpool.model.pool as pool_ops
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.model.state import BlockHash, PoolState


def fine_grained_hits_enabled(
    specs: Sequence[KVCacheSpec], hash_block_size: int, requested: bool, use_eagle: bool
) -> bool:
    """Whether hits may end inside a block: asked for, blocks larger than a hash block,
    every group full attention (vllm#51843), and no EAGLE (which drops one hash block
    from a fine-grained hit in vLLM; kvpool does not model it).

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> fine_grained_hits_enabled([full_attention(4)], 2, True, False)
    True
    >>> fine_grained_hits_enabled([full_attention(4), sliding_window(4, 4)], 2, True, False)
    False
    """
    return (
        requested
        and not use_eagle
        and all(s.attention is AttentionType.FULL for s in specs)
        and all(s.block_size > hash_block_size for s in specs)
    )


def extend_into_partial_block(
    pool: PoolState,
    spec: KVCacheSpec,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    found: tuple[tuple[int, ...], ...],
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Extend a hit of whole blocks into the next block, at its longest cached hash boundary.

    The interior boundaries of the first block past the hit are probed from
    the highest down; the first one every group has cached ends the hit.
    Returns the blocks and the hit's length in tokens.

    Complexity: O(block_size / hash_block_size) lookups.

    >>> from kvpool.model.single_type import full_attention
    >>> extend_into_partial_block(pool_ops.new_pool(4, hash_block_size=1),
    ...     full_attention(2), [b"a"], 1, [0], ((),))
    (((),), 0)
    """
    hbs = pool.config.hash_block_size
    scale = spec.block_size // hbs
    first = len(found[0]) * scale
    top = min(first + scale - 1, max_length // hbs, len(block_hashes))
    for fine_idx in range(top - 1, first - 1, -1):
        tail = pool_ops.get_cached_block(pool, block_hashes[fine_idx], group_ids)
        if tail is None:
            continue
        extended = tuple((*blocks, t) for blocks, t in zip(found, tail, strict=True))
        return extended, (fine_idx + 1) * hbs
    return found, len(found[0]) * spec.block_size
