"""Admission of a whole request: ``allocate_slots(..., full_sequence_must_fit=True)``.

vLLM 0.33's scheduler may admit a waiting request only if the pool could hold
its whole sequence, not just its first chunk (``scheduler_reserve_full_isl``).
Before anything else, ``allocate_slots`` then counts the blocks the request's
``min(num_tokens, max_model_len)`` tokens need, its hits included, and refuses
with None, changing nothing, when the free queue has fewer. Groups that
recycle blocks as the request advances (sliding window, chunked local) count
at most their per-request cap: the most blocks such a group holds at once,
given that up to ``max_in_flight_tokens`` tokens may be scheduled and not yet
processed. A Mamba "align" group counts what a chunk would (at most one
new state block, its free hits; ``kvpool.model.mamba_align.num_blocks_to_allocate``).

Sources: ``KVCacheManager.allocate_slots`` in ``vllm/v1/core/kv_cache_manager.py``,
``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` and
``get_manager_for_kv_cache_spec`` in ``vllm/v1/core/single_type_kv_cache_manager.py``,
``SlidingWindowSpec`` and ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request``
in ``vllm/v1/kv_cache_interface.py``, all vLLM 0.33.0; docs/semantics.md.
"""

from collections.abc import Sequence

import kvpool.model.mamba_fine as mamba_fine
import kvpool.model.mamba_reserve as reserve
from kvpool.model.pool import get_num_free_blocks
from kvpool.model.single_type import AttentionType, KVCacheSpec, ManagersState
from kvpool.model.state import NULL_BLOCK_ID


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_admission_blocks(
    spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int
) -> int | None:
    """The most blocks the group counts for one request at admission (None: no cap).

    Sliding window: the window's ``sliding_window - 1`` earlier tokens plus the
    in-flight ones, capped at ``max_model_len``, in blocks, plus one (the window
    need not start at a block boundary). Chunked local: a chunk plus the
    in-flight tokens, capped so. Full attention and Mamba hold every block they
    are given until the request ends: no cap.

    >>> from kvpool.model.single_type import sliding_window
    >>> max_admission_blocks(sliding_window(4, 4), 4, 64)
    3
    """
    if spec.attention is AttentionType.SLIDING_WINDOW:
        tokens = min(spec.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, spec.block_size) + 1
    if spec.attention is AttentionType.CHUNKED_LOCAL:
        tokens = min(spec.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return _cdiv(tokens, spec.block_size)
    return None


def full_sequence_fits(
    m: ManagersState,
    request_id: str,
    num_tokens: int,
    hits: Sequence[Sequence[int]],
    partial: Sequence[bool],
    max_in_flight_tokens: int,
    max_model_len: int,
    query_start: int = 0,
    scheduler_block_size: int = 0,
) -> bool:
    """Whether the free queue holds the blocks ``num_tokens`` tokens of the request need.

    Per group: the blocks it lacks beyond those it holds and its hits, at most
    the group's cap (``max_admission_blocks``), plus each hit block that is free
    now (taking it empties a free slot) and the copy a hit ending inside a block
    takes (``partial``). A running request takes no hits. A Mamba "align" group counts
    as an allocation of the whole sequence from ``query_start`` tokens would
    (``kvpool.model.mamba_reserve.admission_blocks``; ``scheduler_block_size`` is
    where hits end).

    Complexity: O(groups + hit blocks).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.single_type import new_managers, sliding_window
    >>> m = new_managers(new_pool(4), [sliding_window(2, 2)])
    >>> full_sequence_fits(m, "r", 16, [()], [False], 2, 16)
    True
    """
    needed = 0
    for g, spec in enumerate(m.specs):
        table = m.tables[g]
        if spec.mamba_align:
            if spec.num_speculative_blocks or spec.prefill_checkpoint_alignment:
                # counted as an allocation of the whole sequence from ``query_start`` (the
                # computed tokens and the hit), capped like one (kvpool.model.mamba_reserve)
                held_blocks = table.req_to_blocks.get(request_id, ())
                needed += reserve.admission_blocks(
                    m.pool,
                    table.align,
                    spec,
                    request_id,
                    held_blocks,
                    num_tokens,
                    hits[g],
                    query_start,
                    scheduler_block_size,
                )
                # a hit ending inside a block takes its copy too (kvpool.model.mamba_fine)
                needed += int(partial[g])
                continue
            # at most one state block, as for a chunk: vLLM 0.33.0's MambaManager counts the
            # whole sequence as it counts a chunk (get_num_blocks_to_allocate, align mode)
            states = table.req_to_blocks.get(request_id, ())
            needed += mamba_fine.num_blocks_to_allocate(
                m.pool, table.align, spec.block_size, request_id, states, num_tokens, hits[g]
            )
            # a hit ending inside a block takes its copy too (kvpool.model.mamba_fine)
            needed += int(partial[g])
            continue
        required = _cdiv(num_tokens, spec.block_size)
        cap = max_admission_blocks(spec, max_in_flight_tokens, max_model_len)
        if cap is not None:
            required = min(required, cap)
        held = len(table.req_to_blocks.get(request_id, ()))
        free_hits = sum(1 for b in hits[g] if b != NULL_BLOCK_ID and m.pool.blocks[b].ref_cnt == 0)
        needed += max(required - held - len(hits[g]), 0) + free_hits + int(partial[g])
    return needed <= get_num_free_blocks(m.pool)
