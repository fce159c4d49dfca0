"""EAGLE and multi-module MTP for the fast manager: ``kvpool.model.eagle``'s rules, written again.

The model and the impl share no logic (docs/architecture.md), so the three
rules are here a second time, shaped for the manager's hot paths: the
constructor's checks, how far a hybrid EAGLE search may peek, and how many
computed tokens a group may cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.impl.pool import Unchecked
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.single_type import AttentionType, KVCacheSpec


def check_eagle_config(
    specs: Sequence[KVCacheSpec],
    enable_caching: bool,
    use_eagle: bool,
    num_prefill_lookahead: Unchecked,
    scheduler_block_size: int,
    flags: Sequence[bool] | None = None,
) -> int:
    """Raise InvalidManagerConfig as the model's ``verify_eagle_config`` does; return the
    number of re-prefillable tokens (``num_prefill_lookahead - 1``, at least 0).

    >>> from kvpool.model.single_type import full_attention
    >>> check_eagle_config([full_attention(4)], True, True, 3, 4)
    2
    """
    # Unchecked: the compiled build would raise TypeError (or take True as 1) at the call
    if type(num_prefill_lookahead) is not int:
        raise InvalidManagerConfig(
            f"num_prefill_lookahead must be an int, got {type(num_prefill_lookahead).__name__}"
        )
    lookahead: int = num_prefill_lookahead
    if lookahead < 0:
        raise InvalidManagerConfig(f"num_prefill_lookahead={lookahead} is negative")
    if use_eagle and enable_caching:
        for g, spec in enumerate(specs):
            if spec.attention is AttentionType.CHUNKED_LOCAL and (flags is None or flags[g]):
                raise InvalidManagerConfig(
                    "EAGLE with prefix caching cannot have a chunked-local group"
                )
        if scheduler_block_size < lookahead:
            raise InvalidManagerConfig(
                "multi-module MTP with prefix caching needs "
                f"scheduler_block_size={scheduler_block_size} "
                f">= num_prefill_lookahead={lookahead}"
            )
    return lookahead - 1 if lookahead > 1 else 0


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


def flagged_groups(kv_cache_config: object) -> tuple[int, ...]:
    """The groups flagged as EAGLE's: kvpool's config's ``eagle_groups``, or the groups of
    vLLM's config whose ``is_eagle_group`` is set.

    >>> flagged_groups(object())
    ()
    """
    given = getattr(kv_cache_config, "eagle_groups", None)
    if given is not None:
        # Verify that the flagged groups are a tuple of group ids
        if not isinstance(given, tuple):
            raise InvalidManagerConfig(f"eagle_groups={given!r:.60} must be a tuple of groups")
        return given
    groups = getattr(kv_cache_config, "kv_cache_groups", ())
    return tuple(
        g for g, group in enumerate(groups) if getattr(group, "is_eagle_group", False) is True
    )


def group_flags(
    specs: Sequence[KVCacheSpec], use_eagle: bool, flagged: Sequence[int]
) -> list[bool]:
    """Per group, whether it drops EAGLE's block (``kvpool.model.eagle.group_flags``): the
    flagged groups and their equal siblings with ``use_eagle``, every group when none is
    flagged, none without it. ``flagged`` must name groups of ``specs`` (checked first).

    >>> from kvpool.model.single_type import full_attention, sliding_window
    >>> group_flags([full_attention(4), sliding_window(4, 4)], True, (1,))
    [False, True]
    """
    for g in flagged:
        if type(g) is not int or not 0 <= g < len(specs):
            raise InvalidManagerConfig(
                f"eagle_groups={list(flagged)!r:.60}: not groups of {len(specs)}"
            )
    if len(set(flagged)) < len(flagged):
        raise InvalidManagerConfig(
            f"eagle_groups={list(flagged)!r:.60}: not groups of {len(specs)}"
        )
    if not use_eagle:
        return [False] * len(specs)
    if not flagged:
        return [True] * len(specs)
    chosen = [specs[g] for g in flagged]
    return [spec in chosen for spec in specs]


def check_eagle_flags(
    flagged: Sequence[int],
    enable_caching: bool,
    num_prefill_lookahead: int,
    block_size: int,
) -> None:
    """Raise InvalidManagerConfig where groups flagged as EAGLE's make vLLM 0.33 refuse a
    look-ahead longer than a scheduler block with caching on, even without ``use_eagle``.

    >>> check_eagle_flags((), True, 8, 4) is None
    True
    """
    if not flagged:
        return
    if enable_caching and block_size < num_prefill_lookahead:
        raise InvalidManagerConfig(
            f"multi-module MTP with prefix caching needs scheduler_block_size={block_size} "
            f">= num_prefill_lookahead={num_prefill_lookahead}"
        )
