"""Which managers get hits inside a Mamba "align" block, and which of those kvpool models.

vLLM 0.33.0 turns fine-grained (hash-block) hits on for the whole manager when
a Mamba "align" group's block holds several hash blocks and caching is on
(``partial_hash_hits_enabled`` in ``vllm/v1/core/kv_cache_utils.py``,
``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` in
``vllm/v1/core/kv_cache_coordinator.py``). ``kvpool.model.mamba_fine`` holds the
semantics; this module decides when they apply and refuses by name what is
not modelled. docs/limits.md lists the rest.
"""

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def enabled(specs: Sequence[KVCacheSpec], hash_block_size: int, enable_caching: bool) -> bool:
    """Whether hits may end inside a Mamba "align" block: caching on and some "align" group's
    block longer than a hash block.

    >>> from kvpool.model.single_type import full_attention, mamba_align
    >>> enabled([full_attention(4), mamba_align(8)], 4, True)
    True
    >>> enabled([full_attention(4), mamba_align(4)], 4, True)
    False
    """
    return enable_caching and any(s.mamba_align and s.block_size > hash_block_size for s in specs)


def verify(
    specs: Sequence[KVCacheSpec],
    hash_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
    dcp_world_size: int,
) -> None:
    """Raise InvalidManagerConfig, naming it, for what kvpool does not model beside hits inside a
    Mamba "align" block: the "align" group alone (vLLM's one-group coordinator asserts hash
    block = block), another group that is not full attention, EAGLE, sparse retention,
    decode context parallelism (checkpoint and speculative blocks in the "align" group are
    modelled: ``kvpool.model.mamba_fine_reserve``).

    >>> from kvpool.model.single_type import full_attention, mamba_align, sliding_window
    >>> verify([full_attention(8), mamba_align(8)], 4, False, None, 1)
    >>> verify([sliding_window(4, 4), mamba_align(8)], 4, False, None, 1)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: Mamba "align" with hits inside a block beside ...
    """
    where = f'Mamba "align" with hits inside a block (hash blocks of {hash_block_size} tokens)'
    # Verify that another group runs beside it (vLLM's one-group coordinator refuses it)
    if len(specs) == 1:
        raise InvalidManagerConfig(f"{where} as the only group is not a vLLM configuration")
    for spec in specs:
        # Verify that every other group is full attention
        if not spec.mamba_align and spec.attention is not AttentionType.FULL:
            raise InvalidManagerConfig(
                f'Mamba "align" with hits inside a block beside a {spec.attention.value} group '
                "is not modelled (only full attention)"
            )
    # Verify that neither EAGLE, sparse retention nor context parallelism is on
    if use_eagle:
        raise InvalidManagerConfig(f"{where} with EAGLE is not modelled")
    if retention_interval is not None:
        raise InvalidManagerConfig(f"{where} with sparse retention is not modelled")
    if dcp_world_size != 1:
        raise InvalidManagerConfig(f"{where} with dcp_world_size={dcp_world_size} is not modelled")
