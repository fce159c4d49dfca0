"""Sparse retention for the fast managers: the sliding-window blocks kept under vLLM 0.33's
``prefix_cache_retention_interval`` (semantics: ``kvpool.model.retention``; sources: vLLM
0.33.0, ``vllm/v1/core/kv_cache_coordinator.py`` and
``SlidingWindowManager.reachable_block_mask`` in
``vllm/v1/core/single_type_kv_cache_manager.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.model.errors import InvalidArgument, InvalidManagerConfig, InvalidTokenCount
from kvpool.model.single_type import AttentionType, KVCacheSpec


def check_retention(interval: object, specs: Sequence[KVCacheSpec], scheduler: int) -> None:
    """InvalidManagerConfig unless vLLM 0.33 takes ``interval`` for these groups and kvpool
    models it (not beside a Mamba "align" group with prefill checkpoint blocks). vLLM's own tests
    (tests/v1/core/test_prefix_caching.py) match these messages' words: keep "no
    sliding-window or Mamba", "non-negative" and "multiple of scheduler_block_size"."""
    if interval is None:
        return
    if type(interval) is not int:
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval!r} must be None or an int"
        )
    thinned = [
        s
        for s in specs
        if s.attention is AttentionType.SLIDING_WINDOW or s.attention is AttentionType.MAMBA
    ]
    if not thinned:
        if interval != 0:
            raise InvalidManagerConfig(
                f"prefix_cache_retention_interval={interval} has no effect: there is no "
                "sliding-window or Mamba group (set it to 0 or None)"
            )
        return
    if interval < 0 or interval % scheduler:
        raise InvalidManagerConfig(
            f"prefix_cache_retention_interval={interval} must be non-negative and a "
            f"multiple of scheduler_block_size ({scheduler})"
        )
    for spec in thinned:
        if spec.mamba_align and spec.prefill_checkpoint_alignment:
            raise InvalidManagerConfig(
                f"prefix_cache_retention_interval={interval}: sparse retention of Mamba "
                '"align" prefill checkpoints is not modelled'
            )


def boundaries(
    prompt_len: int,
    scheduler: int,
    eagle: bool,
    shared: int,
    block_size: int,
    replay_eagle: bool | None = None,
) -> list[int]:
    """The token positions whose window the group keeps: where a replay of the prompt resumes
    (with EAGLE, the resend's and the extension's, each a scheduler block back), and the
    scheduler's shared-prefix junction (with EAGLE also one block before it).

    The replay positions follow the manager's EAGLE (``replay_eagle``: any group drops
    EAGLE's block, as vLLM 0.33's coordinator passes ``use_eagle=bool(drop_eagle_group_ids)``
    in ``vllm/v1/core/kv_cache_coordinator.py``), the junction's extra block this group's
    (``eagle``); None: the group's for both."""
    if eagle if replay_eagle is None else replay_eagle:
        resend = (prompt_len - 1) // scheduler * scheduler - scheduler
        extension = prompt_len // scheduler * scheduler - scheduler
        found = sorted({resend if resend > 0 else 0, extension if extension > 0 else 0})
    else:
        found = [prompt_len - 1]
    if shared:
        found.append(shared)
        if eagle:
            found.append(shared - block_size)
    return found


def retention_mask(
    first: int,
    stop: int,
    alignment: int,
    block_size: int,
    window: int,
    eagle: bool,
    interval: int,
    ends: Sequence[int],
) -> list[bool] | None:
    """Which blocks ``first..stop`` a sliding-window group caches under sparse retention
    (None: all): each ``interval`` segment's window tail (none when ``interval`` is 0;
    every block when the tail fills the segment), and the window ending at each of
    ``ends`` rounded down to ``alignment`` (EAGLE's runs end one block later)."""
    run = max(1, (window - 1 + block_size - 1) // block_size)  # a one-token window needs one
    if eagle:
        run += 1
    offset = 1 if eagle else 0
    mask = [False] * (stop - first)
    if interval:
        per_segment = interval // block_size
        if run >= per_segment:
            return None
        # the last ``run`` blocks of each segment (counted from ``offset``)
        for i in range(first, stop):
            if i >= offset and (i - offset) % per_segment >= per_segment - run:
                mask[i - first] = True
    for end_token in ends:
        if end_token < 0:
            continue  # EAGLE's block before a junction at the first block: no window
        end = end_token - end_token % alignment
        last = end // block_size + offset  # one past the run's last block
        lo = last - run if last - run > first else first
        hi = last if last < stop else stop
        for i in range(lo, hi):
            mask[i - first] = True
    return mask


def shared_prefix_boundary(request: object) -> int:
    """The request's ``shared_prefix_boundary`` (0 if it has none: a vLLM release or a
    request type without it); InvalidArgument unless an int, InvalidTokenCount if negative."""
    value = getattr(request, "shared_prefix_boundary", 0)
    if type(value) is not int:
        raise InvalidArgument(f"shared_prefix_boundary must be an int, got {value!r}")
    if value < 0:
        raise InvalidTokenCount(f"shared_prefix_boundary={value} is negative")
    return value


def align_retention_mask(
    first: int, stop: int, alignment: int, block_size: int, interval: int, ends: Sequence[int]
) -> list[bool] | None:
    """Which blocks ``first..stop`` a Mamba "align" group caches under sparse retention
    (None: all): each ``interval`` segment's last block (none when ``interval`` is 0;
    every block when a segment is one block or less), and the block ending at each of
    ``ends`` rounded down to ``alignment``."""
    mask = [False] * (stop - first)
    if interval:
        per_segment = interval // block_size
        if per_segment <= 1:
            return None
        i = (first + per_segment) // per_segment * per_segment - 1
        while i < stop:
            mask[i - first] = True
            i += per_segment
    for end_token in ends:
        last = end_token - end_token % alignment
        last = last // block_size - 1
        if first <= last < stop:
            mask[last - first] = True
    return mask
