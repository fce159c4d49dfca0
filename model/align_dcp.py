"""Mamba "align" beside sharded full attention under decode context parallelism (vLLM 0.33).

With ``dcp_world_size > 1`` a sharded full-attention group's blocks hold
``block_size * dcp_world_size`` tokens while a Mamba group is never sharded
(``kvpool.model.geometry``). vLLM 0.33.0 then turns fine-grained (hash-block)
hits on for the whole manager as soon as some Mamba "align" block is *at
least* one hash block (``partial_hash_hits_enabled`` in
``vllm/v1/core/kv_cache_utils.py``: without DCP it wants a block *longer*
than a hash block), so hits end on hash-block boundaries
(``HybridKVCacheCoordinator._cache_hit_alignment_tokens``), not on scheduler
blocks.

kvpool models the case where every "align" block is one hash block: a hit
never ends inside a Mamba block, the Mamba search keeps the last cached
block at or below the candidate (``kvpool.model.mamba_fine.find_hit`` with
one hash block per block), and a full-attention group of several hash blocks
(a sharded one) reaches into its next block at the highest hash boundary it
cached there (``kvpool.model.copy_on_write.extend_into_partial_block``),
caching the prompt's tail inside a block as every fine-grained full-attention
group does. That is the fine-grained path of
``kvpool.model.mamba_fine_config``, with the same limits (full attention
beside it only, no reserved blocks, no EAGLE, no sparse retention); an
"align" block of several hash blocks under DCP stays refused there.

Sources: vLLM 0.33.0, ``partial_hash_hits_enabled`` and
``resolve_dcp_kv_block_size`` (``vllm/v1/core/kv_cache_utils.py``);
``HybridKVCacheCoordinator.__init__`` / ``find_longest_cache_hit``
(``vllm/v1/core/kv_cache_coordinator.py``); ``FullAttentionManager`` and
``MambaManager.find_longest_cache_hit`` (``vllm/v1/core/single_type_kv_cache_manager.py``);
docs/semantics.md, "Mamba align under decode context parallelism".
"""

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def enabled(
    specs: Sequence[KVCacheSpec], hash_block_size: int, enable_caching: bool, dcp_world_size: int
) -> bool:
    """Whether hits end on hash blocks because of DCP: caching on, ``dcp_world_size > 1``, a
    Mamba "align" group, and every "align" block exactly one hash block (``specs`` with their
    effective block sizes).

    >>> from kvpool.model.single_type import full_attention, mamba_align
    >>> enabled([full_attention(8), mamba_align(4)], 4, True, 2)
    True
    >>> enabled([full_attention(8), mamba_align(4)], 4, True, 1)
    False
    """
    aligned = [s for s in specs if s.mamba_align]
    return (
        enable_caching
        and dcp_world_size > 1
        and bool(aligned)
        and all(s.block_size == hash_block_size for s in aligned)
    )


def verify(
    specs: Sequence[KVCacheSpec],
    hash_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
) -> None:
    """Raise InvalidManagerConfig, naming it, for what kvpool does not model of Mamba "align"
    under decode context parallelism: another group that is not full attention, reserved
    (speculative or checkpoint) blocks in the "align" group, EAGLE, sparse retention.

    >>> from kvpool.model.single_type import full_attention, mamba_align, sliding_window
    >>> verify([full_attention(8), mamba_align(4)], 4, False, None)
    >>> verify([sliding_window(4, 4), mamba_align(4)], 4, False, None)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: Mamba "align" under decode context parallelism ...
    """
    where = f'Mamba "align" under decode context parallelism (hash blocks of {hash_block_size})'
    for spec in specs:
        # Verify that every other group is full attention
        if not spec.mamba_align and spec.attention is not AttentionType.FULL:
            raise InvalidManagerConfig(
                f'Mamba "align" under decode context parallelism beside a '
                f"{spec.attention.value} group is not modelled (only full attention)"
            )
        # Verify that the "align" groups reserve no blocks
        if spec.mamba_align and (spec.num_speculative_blocks or spec.prefill_checkpoint_alignment):
            raise InvalidManagerConfig(
                f"{where} with speculative or prefill checkpoint blocks is not modelled"
            )
    # Verify that neither EAGLE nor sparse retention is on
    if use_eagle:
        raise InvalidManagerConfig(f"{where} with EAGLE is not modelled")
    if retention_interval is not None:
        raise InvalidManagerConfig(f"{where} with sparse retention is not modelled")
