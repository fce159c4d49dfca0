"""The fast manager's Mamba "align" under decode context parallelism, written again.

vLLM 0.33.0 turns hash-block hits on when DCP runs and a Mamba "align" block
is at least one hash block (``partial_hash_hits_enabled``); kvpool models
every "align" block of exactly one hash block, on the fine-grained path
(``kvpool.impl.mamba_fine``). The model's ``kvpool.model.align_dcp`` says the
same; the two share no logic (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def dcp_fine_hits_on(
    specs: Sequence[KVCacheSpec], hash_block_size: int, enable_caching: bool, dcp: int
) -> bool:
    """Caching on, dcp > 1, and every "align" block one hash block (there is one)."""
    if not enable_caching or dcp <= 1:
        return False
    found = False
    for spec in specs:
        if spec.mamba_align:
            if spec.block_size != hash_block_size:
                return False
            found = True
    return found


def check_dcp_config(
    specs: Sequence[KVCacheSpec],
    hash_block_size: int,
    use_eagle: bool,
    retention_interval: int | None,
) -> None:
    """InvalidManagerConfig, by name, as ``kvpool.model.align_dcp.verify``."""
    where = f'Mamba "align" under decode context parallelism (hash blocks of {hash_block_size})'
    for spec in specs:
        if not spec.mamba_align and spec.attention is not AttentionType.FULL:
            raise InvalidManagerConfig(
                f'Mamba "align" under decode context parallelism beside a '
                f"{spec.attention.value} group is not modelled (only full attention)"
            )
        if spec.mamba_align and (spec.num_speculative_blocks or spec.prefill_checkpoint_alignment):
            raise InvalidManagerConfig(
                f"{where} with speculative or prefill checkpoint blocks is not modelled"
            )
    if use_eagle:
        raise InvalidManagerConfig(f"{where} with EAGLE is not modelled")
    if retention_interval is not None:
        raise InvalidManagerConfig(f"{where} with sparse retention is not modelled")
