"""EAGLE and multi-module MTP for the fast manager: ``kvpool.model.eagle``'s rules, written again.

The model and the impl share no logic (docs/architecture.md), so the three
rules are here a second time, shaped for the manager's hot paths: the
constructor's checks, how far a hybrid EAGLE search may peek, and how many
computed tokens a group may cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def check_eagle_config(
    specs: Sequence[KVCacheSpec],
    enable_caching: bool,
    use_eagle: bool,
    num_prefill_lookahead: int,
    scheduler_block_size: int,
) -> int:
    """Raise InvalidManagerConfig as the model's ``verify_eagle_config`` does; return the
    number of re-prefillable tokens (``num_prefill_lookahead - 1``, at least 0).

    >>> from kvpool.model.single_type import full_attention
    >>> check_eagle_config([full_attention(4)], True, True, 3, 4)
    2
    """
    if type(num_prefill_lookahead) is not int:
        raise InvalidManagerConfig(
            f"num_prefill_lookahead must be an int, got {type(num_prefill_lookahead).__name__}"
        )
    if num_prefill_lookahead < 0:
        raise InvalidManagerConfig(f"num_prefill_lookahead={num_prefill_lookahead} is negative")
    if use_eagle and enable_caching:
        for spec in specs:
            if spec.attention is AttentionType.CHUNKED_LOCAL:
                raise InvalidManagerConfig(
                    "EAGLE with prefix caching cannot have a chunked-local group"
                )
        if scheduler_block_size < num_prefill_lookahead:
            raise InvalidManagerConfig(
                "multi-module MTP with prefix caching needs "
                f"scheduler_block_size={scheduler_block_size} "
                f">= num_prefill_lookahead={num_prefill_lookahead}"
            )
    return num_prefill_lookahead - 1 if num_prefill_lookahead > 1 else 0


def cacheable(
    hybrid: bool,
    block_size: int,
    alignment: int,
    eagle: bool,
    fine: bool,
    reprefillable: int,
    num_tokens: int,
) -> int:
    """The computed tokens a group of ``block_size``-token blocks caches of ``num_tokens``,
    hits landing on multiples of ``alignment`` (the model's ``cacheable_tokens``).

    >>> cacheable(True, 4, 4, True, False, 0, 3), cacheable(True, 4, 4, False, False, 0, 7)
    (0, 4)
    >>> cacheable(True, 4, 8, True, False, 0, 15)
    12
    """
    if not hybrid:
        final = num_tokens - reprefillable
        return final if final > 0 else 0
    aligned = num_tokens if fine else num_tokens - num_tokens % alignment
    if not eagle or aligned <= 0:
        return aligned
    final = num_tokens - reprefillable
    if final <= 0:
        return 0
    bound = (final if fine else final - final % alignment) + block_size
    return final if final < bound else bound


def check_eagle_flags(
    kv_cache_config: object,
    use_eagle: bool,
    enable_caching: bool,
    num_prefill_lookahead: int,
    block_size: int,
) -> None:
    """Raise InvalidManagerConfig where vLLM's per-group EAGLE flags (``is_eagle_group``)
    would make vLLM 0.33 differ from kvpool, which models EAGLE on every group.

    With ``use_eagle``, vLLM drops EAGLE's block in the flagged groups, or in
    every group when none is flagged: flags on some groups only are refused.
    Without it no group drops, but flagged groups still make vLLM refuse a
    look-ahead longer than a scheduler block when caching is on: so does this.

    >>> check_eagle_flags(object(), True, True, 0, 4) is None
    True
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", ())
    flags = [getattr(group, "is_eagle_group", False) is True for group in groups]
    if not any(flags):
        return
    if use_eagle and not all(flags):
        raise InvalidManagerConfig(
            "EAGLE flagged on some KV cache groups only (is_eagle_group): kvpool models "
            "EAGLE on every group"
        )
    if enable_caching and block_size < num_prefill_lookahead:
        raise InvalidManagerConfig(
            f"multi-module MTP with prefix caching needs scheduler_block_size={block_size} "
            f">= num_prefill_lookahead={num_prefill_lookahead}"
        )
