"""KV-connector loads at admission: external tokens and reserved blocks.

A KV connector can supply a new request's KV for tokens past its local prefix
hit (``allocate_slots(..., num_external_computed_tokens=N)``): vLLM gives
those tokens blocks of their own in every group, after every group's local hit
has been taken (so that one group's new blocks cannot evict another group's
hit), records them for zeroing unless the group is listed in
``skip_zeroing_group_ids`` (an asynchronous load writes them), and counts
them as computed: they are cached with the rest once the step's tokens are,
and a sliding-window or chunked-local group skips the blocks those tokens
put out of reach (they are nulls in the table; a local hit there is not taken).
``reserved_blocks`` free blocks must remain after the step's allocation (the
admission check of a whole sequence ignores them).

Sources, vLLM 0.33.0: ``KVCacheManager.allocate_slots`` in
``vllm/v1/core/kv_cache_manager.py``; ``allocate_new_computed_blocks`` in
``vllm/v1/core/kv_cache_coordinator.py``; ``SingleTypeKVCacheManager``'s
``get_num_blocks_to_allocate``, ``add_local_computed_blocks`` and
``allocate_external_computed_blocks`` in ``vllm/v1/core/single_type_kv_cache_manager.py``.
docs/semantics.md, "External tokens and reserved blocks".
"""

from collections.abc import Sequence

from kvpool.model.admission import max_admission_blocks
from kvpool.model.errors import (
    HitOnRunningRequest,
    InvalidArgument,
    InvalidTokenCount,
    UnknownGroup,
)
from kvpool.model.pool import get_num_free_blocks
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType, KVCacheSpec, ManagersState
from kvpool.model.state import NULL_BLOCK_ID, PoolState


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_skipped_tokens(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """The leading tokens no later token of a request with ``num_computed_tokens`` attends to.

    >>> from kvpool.model.single_type import sliding_window, full_attention
    >>> num_skipped_tokens(sliding_window(4, 6), 12), num_skipped_tokens(full_attention(4), 12)
    (7, 0)
    """
    if spec.attention is AttentionType.SLIDING_WINDOW:
        return max(0, num_computed_tokens - spec.sliding_window + 1)
    if spec.attention is AttentionType.CHUNKED_LOCAL:
        chunk = spec.attention_chunk_size
        return num_computed_tokens // chunk * chunk
    return 0


def num_skipped_blocks(spec: KVCacheSpec, num_computed_tokens: int) -> int:
    """The whole blocks of ``num_skipped_tokens``: nulls at the front of the table.

    >>> from kvpool.model.single_type import sliding_window
    >>> num_skipped_blocks(sliding_window(4, 6), 12)
    1
    """
    return num_skipped_tokens(spec, num_computed_tokens) // spec.block_size


def num_blocks_to_allocate(
    pool: PoolState,
    spec: KVCacheSpec,
    num_tokens: int,
    hits: Sequence[int],
    num_total_computed_tokens: int,
    cap: int | None = None,
) -> int:
    """The free blocks a request holding nothing takes for ``num_tokens`` slots in one group
    when external tokens bring its computed tokens to ``num_total_computed_tokens``.

    The blocks it lacks beyond its hit and its skipped blocks (whichever reach
    further; ``num_tokens`` counted at most ``cap`` blocks at admission), plus
    each hit block past the skipped ones that is free now (taking it empties a
    free slot).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.single_type import sliding_window
    >>> num_blocks_to_allocate(new_pool(8), sliding_window(4, 4), 16, [], 12)
    2
    """
    required = _cdiv(num_tokens, spec.block_size)
    if cap is not None:
        required = min(required, cap)
    skipped = num_skipped_blocks(spec, num_total_computed_tokens)
    lacking = max(required - max(skipped, len(hits)), 0)
    evictable = sum(1 for b in hits[skipped:] if b != NULL_BLOCK_ID and pool.blocks[b].ref_cnt == 0)
    return lacking + evictable


def taken_hits(
    spec: KVCacheSpec, hits: Sequence[int], num_total_computed_tokens: int
) -> tuple[int, tuple[int, ...]]:
    """How many nulls start the table, and the hit blocks taken after them.

    >>> from kvpool.model.single_type import sliding_window
    >>> taken_hits(sliding_window(4, 4), (5, 6), 12)
    (2, ())
    """
    skipped = num_skipped_blocks(spec, num_total_computed_tokens)
    return skipped, tuple(hits[skipped:])


def num_external_blocks(
    spec: KVCacheSpec,
    num_held: int,
    num_local_computed_tokens: int,
    num_external_computed_tokens: int,
) -> int:
    """The new blocks a group gives the external tokens, its table holding ``num_held``.

    None if every external token is skipped; else enough for every computed
    token.

    >>> from kvpool.model.single_type import full_attention
    >>> num_external_blocks(full_attention(4), 1, 4, 6)
    2
    """
    total = num_local_computed_tokens + num_external_computed_tokens
    skipped = num_skipped_tokens(spec, total)
    external = num_external_computed_tokens
    if skipped > 0:
        external = min(total - skipped, external)
    if external <= 0:
        return 0
    return max(0, _cdiv(total, spec.block_size) - num_held)


def full_sequence_fits(
    m: ManagersState,
    num_tokens: int,
    hits: Sequence[Sequence[int]],
    num_total_computed_tokens: int,
    max_in_flight_tokens: int,
    max_model_len: int,
) -> bool:
    """``kvpool.model.admission.full_sequence_fits`` for a request holding nothing that comes
    with external tokens: each group counts ``num_blocks_to_allocate`` for ``num_tokens``
    at most its admission cap (``reserved_blocks`` play no part).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.single_type import new_managers, full_attention
    >>> full_sequence_fits(new_managers(new_pool(4), [full_attention(2)]), 8, [()], 4, 8, 8)
    False
    """
    total = min(num_total_computed_tokens, max_model_len)
    needed = sum(
        num_blocks_to_allocate(
            m.pool,
            spec,
            num_tokens,
            hits[g],
            total,
            max_admission_blocks(spec, max_in_flight_tokens, max_model_len),
        )
        for g, spec in enumerate(m.specs)
    )
    return needed <= get_num_free_blocks(m.pool)


def verify_connector_arguments(
    m: ManagersState,
    request: Request,
    num_new_computed_tokens: int,
    num_external_computed_tokens: int,
    reserved_blocks: int,
    skip_zeroing_group_ids: Sequence[int],
) -> None:
    """Raise the named error for KV-connector arguments ``allocate_slots`` cannot take.

    Checked: the counts are not negative; the local hit and the external tokens
    lie within the request's tokens; external tokens come only for a request
    holding no blocks (vLLM 0.33 ignores them for one that does, where its
    scheduler never sends them) and beside no Mamba group (not modelled); the
    groups not to zero exist.

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.request import new_request
    >>> from kvpool.model.single_type import new_managers, full_attention
    >>> m = new_managers(new_pool(4), [full_attention(2)])
    >>> verify_connector_arguments(m, new_request("r", [1, 2, 3], 2), 0, 2, 0, ())
    >>> verify_connector_arguments(m, new_request("r", [1, 2, 3], 2), 0, 0, -1, ())
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidTokenCount: reserved_blocks=-1 must be >= 0
    """
    ext = num_external_computed_tokens
    # Verify that the reservation is not negative
    if reserved_blocks < 0:
        raise InvalidTokenCount(f"reserved_blocks={reserved_blocks} must be >= 0")
    # Verify that the external tokens are not negative
    if ext < 0:
        raise InvalidTokenCount(f"num_external_computed_tokens={ext} must be >= 0")
    # Verify that the groups not to zero exist
    for g in skip_zeroing_group_ids:
        if type(g) is not int or not 0 <= g < len(m.specs):
            raise UnknownGroup(f"skip_zeroing_group_ids names {g!r}: no such group")
    if ext == 0:
        return
    computed = request.num_computed_tokens + num_new_computed_tokens
    # Verify that the computed tokens, external ones included, are the request's
    if computed + ext > request.num_tokens:
        raise InvalidTokenCount(
            f"{computed} computed and {ext} external tokens exceed the request's "
            f"{request.num_tokens} tokens"
        )
    # Verify that only a request holding no blocks takes external tokens
    if any(request.request_id in t.req_to_blocks for t in m.tables):
        raise HitOnRunningRequest(
            f"request {request.request_id!r} already holds blocks: external tokens "
            "come only with its first allocation"
        )
    # Verify that no Mamba group takes external tokens (not modelled)
    if any(s.attention is AttentionType.MAMBA for s in m.specs):
        raise InvalidArgument("external tokens beside a Mamba group: not modelled")
