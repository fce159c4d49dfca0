"""Hit alignment: the arithmetic of hits that end on multiples of an alignment.

With several KV cache groups (``kvpool.model.geometry``) every hit length is a
multiple of the scheduler block size, which may span several blocks of a
group. These functions take plain numbers, so the single-type managers can
use them. Sources: vLLM 0.33.0, ``vllm/v1/core/single_type_kv_cache_manager.py``
(``FullAttentionManager.find_longest_cache_hit``'s round-down,
``SlidingWindowManager.find_longest_cache_hit`` and ``reachable_block_mask``).
"""


def aligned_length(num_tokens: int, alignment: int) -> int:
    """The hit-length rule: the longest multiple of ``alignment`` within ``num_tokens``.

    A full-attention hit of 3 blocks of 16 tokens, aligned to 32, is 32 tokens:

    >>> aligned_length(48, 32)
    32
    """
    return num_tokens - num_tokens % alignment


def sliding_window_cache_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    sliding_window: int,
    use_eagle: bool,
) -> tuple[bool, ...] | None:
    """Which of blocks ``start_block..end_block`` a sliding-window group caches (None: all).

    A hit ends on a multiple of ``alignment`` and needs the run of blocks
    covering the window before it (one more with EAGLE, whose last block is
    dropped). Within each ``alignment``-token segment only that run's blocks
    can ever serve a hit, so only they are cached; when the run is as long as
    the segment, every block is. Source: vLLM 0.33.0,
    ``SlidingWindowManager.reachable_block_mask`` (dense retention, the default).
    A window of one token needs the one block before the boundary, as its hit
    does (0.33.0 caches no block of such a window: docs/semantics.md, known
    differences).

    >>> sliding_window_cache_mask(0, 8, 32, 8, 8, False)
    (False, False, False, True, False, False, False, True)
    >>> sliding_window_cache_mask(0, 2, 8, 8, 8, False) is None
    True
    """
    if alignment % block_size != 0:
        return None
    need = max(1, -(-(sliding_window - 1) // block_size)) + (1 if use_eagle else 0)
    per_segment = alignment // block_size
    if need >= per_segment:
        return None
    shift = 1 if use_eagle else 0
    return tuple(
        i >= shift and (i - shift) % per_segment >= per_segment - need
        for i in range(start_block, end_block)
    )


def ends_aligned(num_blocks: int, block_size: int, alignment: int) -> bool:
    """Whether ``num_blocks`` blocks of ``block_size`` tokens end on a multiple of ``alignment``.

    >>> ends_aligned(3, 16, 32), ends_aligned(4, 16, 32)
    (False, True)
    """
    return num_blocks * block_size % alignment == 0
