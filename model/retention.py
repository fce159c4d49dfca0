"""Sparse retention: which sliding-window blocks a manager keeps cached under a retention interval.

vLLM 0.33 takes ``prefix_cache_retention_interval`` in its ``KVCacheConfig``:

* ``None``: dense, as before (``kvpool.model.alignment.sliding_window_cache_mask``);
* ``0``: a sliding-window group caches only the blocks a replay of the prompt
  (or a request sharing a detected prefix) can resume from;
* ``N > 0`` (a multiple of the scheduler block size): those, plus the window's
  tail at the end of every ``N``-token segment.

Full-attention and chunked-local groups cache densely whatever the interval.
Sources (vLLM 0.33.0): ``_validate_prefix_cache_retention_interval`` and
``replay_boundaries`` in ``vllm/v1/core/kv_cache_coordinator.py``;
``SingleTypeKVCacheManager.cache_blocks`` and
``SlidingWindowManager.reachable_block_mask`` in
``vllm/v1/core/single_type_kv_cache_manager.py``. Mamba "align" groups thin
their state snapshots too (``mamba_align_retention_mask``, after
``MambaManager.reachable_block_mask`` there; beside EAGLE too:
``kvpool.model.mamba_align_eagle``), not with prefill checkpoint blocks (the
constructors refuse those: ``kvpool.model.retention_config``).
Plain numbers only, so the single-type managers can use them.
"""

from collections.abc import Sequence


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """The token positions a later request replaying this prompt can resume at.

    Without EAGLE, a resend of the prompt hits at most ``num_prompt_tokens - 1``
    tokens (rounded down by the mask to the hit alignment), and a longer sibling
    hits no later block boundary. With EAGLE the hit drops one scheduler block
    after its lookup, and the resend (capped one token short) and the extension
    (the whole prompt) may land on different scheduler blocks: both are kept.

    >>> replay_boundaries(256, 16, False)
    (255,)
    >>> replay_boundaries(127, 32, True)
    (64,)
    >>> replay_boundaries(128, 32, True)
    (64, 96)
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def reachable_boundaries(
    replay: Sequence[int], shared_prefix_boundary: int, block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """The boundaries whose window tail a group keeps: the replay boundaries and, when the
    scheduler noted one (``shared_prefix_boundary`` > 0), the shared prefix's junction
    (with EAGLE also one of the group's blocks before it, where a sibling diverging right
    after the junction lands).

    >>> reachable_boundaries((255,), 64, 16, True)
    (255, 64, 48)
    """
    if not shared_prefix_boundary:
        return tuple(replay)
    extra = (shared_prefix_boundary - block_size,) if use_eagle else ()
    return (*replay, shared_prefix_boundary, *extra)


def sliding_window_retention_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    sliding_window: int,
    use_eagle: bool,
    interval: int,
    boundaries: Sequence[int],
) -> tuple[bool, ...] | None:
    """Which of blocks ``start_block..end_block`` a sliding-window group caches under a
    retention ``interval`` (not None) and the ``boundaries`` it must stay reachable at
    (None: every block).

    A hit needs the run of ``need`` blocks covering the window before its end
    (one more with EAGLE, whose run ends one block past the hit). With
    ``interval`` > 0 the run ending on every ``interval``-token segment is kept,
    and every block if the run fills the segment; with 0 none is. Then the run
    ending at each boundary, rounded down to ``alignment``, is kept. As with
    dense retention, a window of one token needs one block here (vLLM 0.33.0
    keeps none: docs/semantics.md, known differences).

    >>> mask = sliding_window_retention_mask(0, 16, 16, 16, 16, False, 64, (255,))
    >>> [i for i, kept in enumerate(mask) if kept]
    [3, 7, 11, 14, 15]
    >>> mask = sliding_window_retention_mask(0, 16, 16, 16, 16, False, 0, (255,))
    >>> [i for i, kept in enumerate(mask) if kept]
    [14]
    """
    need = max(1, -(-(sliding_window - 1) // block_size)) + (1 if use_eagle else 0)
    shift = 1 if use_eagle else 0
    keep = [False] * (end_block - start_block)
    if interval > 0:
        per_segment = interval // block_size
        if need >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i >= shift and (i - shift) % per_segment >= per_segment - need:
                keep[i - start_block] = True
    for boundary in boundaries:
        end = boundary // alignment * alignment // block_size + shift
        for i in range(max(start_block, end - need), min(end_block, end)):
            keep[i - start_block] = True
    return tuple(keep)


def mamba_align_retention_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    interval: int,
    boundaries: Sequence[int],
) -> tuple[bool, ...] | None:
    """Which of blocks ``start_block..end_block`` a Mamba "align" group caches under a
    retention ``interval`` (not None) and the ``boundaries`` it must stay reachable at
    (None: every block).

    A Mamba hit needs only the one state block ending on the hit, so a group keeps
    the last block of every ``interval``-token segment (every block when a segment
    is one block or less; none when ``interval`` is 0) and the block ending at each
    boundary rounded down to ``alignment`` (none for a boundary below one block).

    >>> mask = mamba_align_retention_mask(0, 8, 16, 16, 64, (95,))
    >>> [i for i, kept in enumerate(mask) if kept]
    [3, 4, 7]
    >>> mask = mamba_align_retention_mask(0, 8, 16, 16, 0, (95, 32))
    >>> [i for i, kept in enumerate(mask) if kept]
    [1, 4]
    >>> mamba_align_retention_mask(0, 8, 16, 16, 16, ()) is None
    True
    """
    keep = [False] * (end_block - start_block)
    if interval > 0:
        per_segment = interval // block_size
        if per_segment <= 1:
            return None
        for i in range(start_block, end_block):
            if (i + 1) % per_segment == 0:
                keep[i - start_block] = True
    for boundary in boundaries:
        last = boundary // alignment * alignment // block_size - 1
        if start_block <= last < end_block:
            keep[last - start_block] = True
    return tuple(keep)
