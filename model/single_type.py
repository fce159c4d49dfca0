"""The single-type managers: one KV cache group's block tables, per attention type.

A KV cache group is a set of layers sharing one attention type and one
block table per request. Its manager decides which cached blocks a request
may reuse (``find_longest_cache_hit``), how many blocks an allocation costs,
which blocks leave the attention window (``remove_skipped_blocks``), and it
hands out, caches and frees blocks through the shared block pool. Four
attention types:

* full attention: every token attends to every earlier token; a hit is the
  longest run of cached blocks from the start;
* sliding window: a token attends to the ``sliding_window`` tokens up to
  itself; blocks entirely before the window are replaced by the null block,
  and a hit needs only enough contiguous cached blocks to cover the window;
* chunked local attention: a token attends to the tokens of its own chunk
  of ``attention_chunk_size``; blocks of earlier chunks are null;
* Mamba: a recurrent state of one block per request, never a prefix hit and
  never cached; or, in vLLM's "align" mode (``mamba_align``), one state block
  per block of tokens, cached at block boundaries (``kvpool.model.mamba_align``).

Every operation is a pure function over ``ManagersState``, which holds the
block pool (``kvpool.model.pool`` does all the pool's work) and one
``GroupTable`` per group. Semantics: seed ``002_1ac62bb789e467a7.txt``;
docs/semantics.md, "The request layer", lists what decided the rest.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import kvpool.model.mamba_align as align_mode
import kvpool.model.mamba_fine as fine
import kvpool.model.mamba_fine_reserve as fine_reserve
import kvpool.model.mamba_reserve as reserve
from kvpool.model.alignment import aligned_length, ends_aligned, sliding_window_cache_mask
from kvpool.model.errors import (
    HitOnRunningRequest,
    InvalidManagerConfig,
    InvalidTokenCount,
    UnknownGroup,
    UnknownRequest,
)
from kvpool.model.pool import (
    cache_full_blocks,
    cache_partial_block,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    hashes_at_block_size,
)
from kvpool.model.request import Request, cache_request, verify_hash_block_size
from kvpool.model.retention import (
    mamba_align_retention_mask,
    reachable_boundaries,
    sliding_window_retention_mask,
)
from kvpool.model.state import NULL_BLOCK_ID, BlockHash, PoolState

# --------------------------------------------------------------------------
# Specs and state
# --------------------------------------------------------------------------


class AttentionType(Enum):
    """The attention type of a KV cache group."""

    FULL = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local_attention"
    MAMBA = "mamba"


@dataclass(frozen=True)
class KVCacheSpec:
    """What a group's manager needs to know about its layers."""

    attention: AttentionType
    block_size: int
    sliding_window: int = 0
    """Tokens a query attends to, itself included (sliding window only)."""
    attention_chunk_size: int = 0
    """Tokens per attention chunk (chunked local attention only)."""
    mamba_align: bool = False
    """Mamba in vLLM's "align" cache mode: blocks as small as the others', states cached at
    block boundaries (``kvpool.model.mamba_align``). Mamba only."""
    dcp_sharded: bool = True
    """Decode context parallelism shards the group's tokens across ranks, so the manager's
    blocks hold ``block_size * dcp_world_size`` tokens (``kvpool.model.geometry``). vLLM
    0.33's attention specs default to True, its Mamba spec to False."""
    num_speculative_blocks: int = 0
    """Blocks a Mamba "align" group keeps past the one its tokens end in, for drafts
    (vLLM's ``MambaSpec.num_speculative_blocks``; ``kvpool.model.mamba_reserve``)."""
    prefill_checkpoint_alignment: int = 0
    """A Mamba "align" group's prefill checkpoints are this many tokens apart from a chunk's
    start; 0: no checkpoint blocks (vLLM's ``num_prefill_checkpoint_blocks`` > 0 with its
    ``prefill_checkpoint_alignment``; ``kvpool.model.mamba_reserve``)."""


def full_attention(block_size: int) -> KVCacheSpec:
    """A full-attention group of ``block_size``-token blocks.

    >>> full_attention(4).attention.value
    'full_attention'
    """
    return KVCacheSpec(AttentionType.FULL, block_size)


def sliding_window(block_size: int, window: int) -> KVCacheSpec:
    """A sliding-window group: each token attends to the ``window`` tokens ending at it.

    >>> sliding_window(4, 8).sliding_window
    8
    """
    return KVCacheSpec(AttentionType.SLIDING_WINDOW, block_size, sliding_window=window)


def chunked_local(block_size: int, chunk_size: int) -> KVCacheSpec:
    """A chunked-local-attention group with chunks of ``chunk_size`` tokens.

    >>> chunked_local(4, 8).attention_chunk_size
    8
    """
    return KVCacheSpec(AttentionType.CHUNKED_LOCAL, block_size, attention_chunk_size=chunk_size)


def mamba(block_size: int) -> KVCacheSpec:
    """A Mamba group: one state block per request, at least max_model_len tokens large.

    >>> mamba(64).attention.value
    'mamba'
    """
    return KVCacheSpec(AttentionType.MAMBA, block_size, dcp_sharded=False)


def mamba_align(block_size: int) -> KVCacheSpec:
    """A Mamba group in "align" mode: one state block per ``block_size`` tokens.

    >>> mamba_align(16).mamba_align
    True
    """
    return KVCacheSpec(AttentionType.MAMBA, block_size, mamba_align=True, dcp_sharded=False)


def mamba_reserving(
    block_size: int, num_speculative_blocks: int = 0, prefill_checkpoint_alignment: int = 0
) -> KVCacheSpec:
    """A Mamba "align" group that also keeps speculative blocks and prefill checkpoints.

    >>> mamba_reserving(4, 1, 4).num_speculative_blocks
    1
    """
    return replace(
        mamba_align(block_size),
        num_speculative_blocks=num_speculative_blocks,
        prefill_checkpoint_alignment=prefill_checkpoint_alignment,
    )


@dataclass(frozen=True)
class GroupTable:
    """One group's bookkeeping: each request's blocks, and how many of them are cached.

    A request is in both maps or in neither: it enters when its first
    allocation succeeds and leaves when it is freed.
    """

    req_to_blocks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Request id to its block table; the null block stands for skipped blocks."""
    num_cached_block: Mapping[str, int] = field(default_factory=dict)
    """Request id to the number of leading blocks already in the hash map."""
    align: align_mode.AlignTable = field(default_factory=align_mode.AlignTable)
    """A Mamba "align" group's further bookkeeping (empty for every other group)."""


@dataclass(frozen=True)
class ManagersState:
    """Every group's manager and the block pool they share. Group i hashes with group id i."""

    pool: PoolState
    specs: tuple[KVCacheSpec, ...]
    tables: tuple[GroupTable, ...]


def new_managers(pool: PoolState, specs: Sequence[KVCacheSpec]) -> ManagersState:
    """Managers for ``specs`` over ``pool``, holding no request.

    Complexity: O(len(specs)).

    >>> from kvpool.model.pool import new_pool
    >>> len(new_managers(new_pool(4), [full_attention(1)]).tables)
    1
    """
    hbs = pool.config.hash_block_size
    # Verify that there is at least one group
    if not specs:
        raise InvalidManagerConfig("a KV cache manager needs at least one group")
    for spec in specs:
        # Verify that each block size is a positive multiple of the hash block size
        if spec.block_size < hbs or spec.block_size % hbs != 0:
            raise InvalidManagerConfig(
                f"block_size={spec.block_size} is not a multiple of hash_block_size={hbs}"
            )
        # Verify that only Mamba groups are in "align" mode
        if spec.mamba_align and spec.attention is not AttentionType.MAMBA:
            raise InvalidManagerConfig(f"{spec.attention.value} groups have no align mode")
        # Verify that only Mamba "align" groups reserve blocks, never a negative number
        reserve.verify_reserving(
            spec.mamba_align, spec.num_speculative_blocks, spec.prefill_checkpoint_alignment
        )
        # Verify that windows and chunks are positive
        if spec.attention is AttentionType.SLIDING_WINDOW and spec.sliding_window < 1:
            raise InvalidManagerConfig(f"sliding_window={spec.sliding_window} must be positive")
        if spec.attention is AttentionType.CHUNKED_LOCAL and spec.attention_chunk_size < 1:
            raise InvalidManagerConfig(
                f"attention_chunk_size={spec.attention_chunk_size} must be positive"
            )
    return ManagersState(pool, tuple(specs), tuple(GroupTable() for _ in specs))


# --------------------------------------------------------------------------
# Cache-hit search (queries over the pool)
# --------------------------------------------------------------------------


def find_longest_cache_hit(
    pool: PoolState,
    spec: KVCacheSpec,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    use_eagle: bool = False,
    alignment: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """The cached blocks a request may reuse, one tuple per group of ``group_ids``.

    The hit covers at most ``max_length`` tokens and is common to every
    group listed (they share ``spec``). Skipped positions (outside a sliding
    window or before the current chunk) hold the null block. With EAGLE the
    last matched block is dropped, so the drafter recomputes it. With an
    ``alignment`` (several groups of different block sizes,
    ``kvpool.model.geometry``) the hit's length is a multiple of it: a
    full-attention hit is cut back to one, a sliding-window run must end on one.

    Complexity: O(max_length / block_size * len(group_ids)).

    >>> from kvpool.model.pool import new_pool
    >>> find_longest_cache_hit(new_pool(4), full_attention(1), [b"h"], 1, [0])
    ((),)
    """
    # Verify that at least one group is searched and none is negative
    if not group_ids or min(group_ids) < 0:
        raise UnknownGroup(f"cannot search groups {list(group_ids)}")
    # Verify that the length is not negative
    if max_length < 0:
        raise InvalidTokenCount(f"max_length={max_length} is negative")
    # Verify that the alignment, if any, is a whole number of blocks
    if alignment < 0 or alignment % spec.block_size != 0:
        raise InvalidTokenCount(
            f"alignment={alignment} is not a multiple of the {spec.block_size}-token block"
        )

    hashes = hashes_at_block_size(block_hashes, pool.config.hash_block_size, spec.block_size)
    max_blocks = min(max_length // spec.block_size, len(hashes))
    kind = spec.attention
    alignment = alignment or spec.block_size
    if spec.mamba_align:
        return align_mode.find_hit(pool, spec.block_size, hashes, max_length, group_ids, alignment)
    if kind is AttentionType.FULL:
        hit = _prefix_hit(pool, hashes, 0, max_blocks, group_ids)
        if use_eagle and hit:
            hit.pop()
        hit = hit[: aligned_length(len(hit) * spec.block_size, alignment) // spec.block_size]
    elif kind is AttentionType.SLIDING_WINDOW:
        hit = _sliding_window_hit(pool, spec, hashes, max_blocks, group_ids, use_eagle, alignment)
    elif kind is AttentionType.CHUNKED_LOCAL:
        chunk = spec.attention_chunk_size
        first = min(max_length // chunk * chunk // spec.block_size, max_blocks)
        skipped = [tuple(NULL_BLOCK_ID for _ in group_ids)] * first
        hit = skipped + _prefix_hit(pool, hashes, first, max_blocks, group_ids)
    else:
        hit = []
    return tuple(tuple(blocks[g] for blocks in hit) for g in range(len(group_ids)))


def _prefix_hit(
    pool: PoolState,
    hashes: Sequence[BlockHash],
    start: int,
    stop: int,
    group_ids: Sequence[int],
) -> list[tuple[int, ...]]:
    """Blocks ``start..`` while every group has one cached, stopping at the first miss."""
    hit: list[tuple[int, ...]] = []
    for i in range(start, stop):
        found = get_cached_block(pool, hashes[i], group_ids)
        if found is None:
            break
        hit.append(found)
    return hit


def _sliding_window_hit(
    pool: PoolState,
    spec: KVCacheSpec,
    hashes: Sequence[BlockHash],
    max_blocks: int,
    group_ids: Sequence[int],
    use_eagle: bool,
    alignment: int,
) -> list[tuple[int, ...]]:
    """Right to left: the last run of ``needed`` contiguous cached blocks, nulls before it.

    Without such a run, the run of cached blocks from the start (shorter than
    the window) is the hit. A run starts only where the hit would end on a
    multiple of ``alignment`` (after EAGLE's drop); the hit is cut back to one.
    """
    size = spec.block_size
    needed = _cdiv(spec.sliding_window - 1, size) + (1 if use_eagle else 0)
    null = tuple(NULL_BLOCK_ID for _ in group_ids)
    hit = [null] * max_blocks
    run = 0
    end: int | None = None
    for i in range(max_blocks - 1, -1, -1):
        found = get_cached_block(pool, hashes[i], group_ids)
        if found is None:
            run = 0
            continue
        if run == 0 and not ends_aligned(i if use_eagle else i + 1, size, alignment):
            continue
        hit[i] = found
        run += 1
        if run >= needed:
            end = i + run
            break
    hit = hit[:end] if end is not None else hit[:run]
    if end is None:
        hit = hit[: aligned_length(len(hit) * size, alignment) // size]
    if use_eagle and hit:
        hit.pop()
        hit = hit[: aligned_length(len(hit) * size, alignment) // size]
    return hit


# --------------------------------------------------------------------------
# Allocation
# --------------------------------------------------------------------------


def get_num_blocks_to_allocate(
    state: ManagersState,
    group: int,
    request_id: str,
    num_tokens: int,
    new_computed_blocks: Sequence[int],
) -> int:
    """How many free blocks giving the request ``num_tokens`` slots in ``group`` takes.

    The new blocks it lacks, plus one per hit block that is free now (an
    eviction candidate): touching it takes it out of the free queue. The
    null block is never free and costs nothing.

    Complexity: O(len(new_computed_blocks)).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(8), [full_attention(2)])
    >>> get_num_blocks_to_allocate(m, 0, "r", 5, [])
    3
    """
    spec, table = _group(state, group)
    if _reserves(spec):
        return reserve.num_blocks_to_allocate(
            state.pool,
            table.align,
            spec.block_size,
            spec.num_speculative_blocks,
            request_id,
            table.req_to_blocks.get(request_id, ()),
            num_tokens,
            new_computed_blocks,
        )
    if spec.mamba_align:
        held_blocks = table.req_to_blocks.get(request_id, ())
        # a pending producer copy (hits inside a block) takes its block too
        return fine.num_blocks_to_allocate(
            state.pool,
            table.align,
            spec.block_size,
            request_id,
            held_blocks,
            num_tokens,
            new_computed_blocks,
        )
    held = len(table.req_to_blocks.get(request_id, ()))
    lacking = max(0, _cdiv(num_tokens, spec.block_size) - len(new_computed_blocks) - held)
    evictable = sum(
        1 for b in new_computed_blocks if b != NULL_BLOCK_ID and state.pool.blocks[b].ref_cnt == 0
    )
    return lacking + evictable


def plan_checkpoint(
    state: ManagersState,
    group: int,
    request_id: str,
    query_start: int,
    query_end: int,
    cache_alignment: int,
) -> tuple[ManagersState, None]:
    """Record whether a chunk ``query_start..query_end`` keeps a prefill checkpoint in ``group``.

    What vLLM 0.33.0's ``MambaManager.get_num_blocks_to_allocate`` records while it
    counts (``kvpool.model.mamba_reserve.plan_checkpoint``); every group but a
    Mamba "align" group with checkpoint blocks is left as it is. ``cache_alignment``
    is what hits are a multiple of (the scheduler block size); the pool's hash block when
    caching is on and the group's block is longer (``mamba_reserve.checkpoint_alignment_of``).

    Complexity: O(1).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(8, hash_block_size=4), [mamba_reserving(4, 0, 4)])
    >>> dict(plan_checkpoint(m, 0, "r", 0, 8, 4)[0].tables[0].align.checkpoints)
    {'r': (4, 0)}
    """
    spec, table = _group(state, group)
    if not spec.prefill_checkpoint_alignment:
        return state, None
    # Verify that the chunk's bounds are counts of tokens in order
    if not 0 <= query_start <= query_end:
        raise InvalidTokenCount(f"a chunk {query_start}..{query_end} is not in order")
    align = reserve.plan_checkpoint(
        table.align,
        spec.block_size,
        spec.num_speculative_blocks,
        spec.prefill_checkpoint_alignment,
        request_id,
        table.req_to_blocks.get(request_id, ()),
        query_start,
        query_end,
        # the hash block when hits may end inside the group's blocks (kvpool.model.mamba_fine)
        reserve.checkpoint_alignment_of(state.pool, spec, cache_alignment),
        state.pool.config.hash_block_size,
        state.pool.config.num_hash_lookahead_tokens,
    )
    return _with_table(state, group, replace(table, align=align)), None


def save_new_computed_blocks(
    state: ManagersState, group: int, request_id: str, new_computed_blocks: Sequence[int]
) -> tuple[ManagersState, None]:
    """Start the request's block table in ``group`` with its cache hits (touched already).

    A request seen for the first time enters the tables, its hit blocks
    counted as cached. A request already holding blocks cannot take hits:
    they must be empty.

    Complexity: O(len(new_computed_blocks)).

    >>> from kvpool.model.pool import new_pool
    >>> m, _ = save_new_computed_blocks(new_managers(new_pool(4), [full_attention(1)]), 0, "r", [])
    >>> dict(m.tables[0].req_to_blocks)
    {'r': ()}
    """
    _, table = _group(state, group)
    if request_id in table.req_to_blocks:
        # Verify that a request holding blocks gets no new hits
        if new_computed_blocks:
            raise HitOnRunningRequest(f"request {request_id!r} already holds blocks")
        return state, None
    table = replace(
        table,
        req_to_blocks={**table.req_to_blocks, request_id: tuple(new_computed_blocks)},
        num_cached_block={**table.num_cached_block, request_id: len(new_computed_blocks)},
    )
    return _with_table(state, group, table), None


def allocate_new_blocks(
    state: ManagersState, group: int, request_id: str, num_tokens: int
) -> tuple[ManagersState, tuple[int, ...]]:
    """Append fresh blocks to the request's table until it has ``num_tokens`` slots.

    Returns the new blocks (none if it has enough). The pool hands them out
    from the front of its free queue, evicting their hashes.

    Complexity: O(number of new blocks).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(4), [full_attention(2)])
    >>> m, _ = save_new_computed_blocks(m, 0, "r", [])
    >>> allocate_new_blocks(m, 0, "r", 3)[1]
    (1, 2)
    """
    spec, table = _group(state, group)
    # Verify that the request is in the group's tables
    _verify_request(table, request_id)
    blocks = table.req_to_blocks[request_id]
    if spec.mamba_align:
        pool, tables, blocks, new = (
            reserve.allocate(
                state.pool,
                table.align,
                spec.block_size,
                spec.num_speculative_blocks,
                request_id,
                blocks,
                num_tokens,
            )
            if _reserves(spec)
            else align_mode.allocate(
                state.pool, table.align, spec.block_size, request_id, blocks, num_tokens
            )
        )
        table = replace(
            table, align=tables, req_to_blocks={**table.req_to_blocks, request_id: blocks}
        )
        return _with_table(replace(state, pool=pool), group, table), new
    lacking = _cdiv(num_tokens, spec.block_size) - len(blocks)
    if lacking <= 0:
        return state, ()
    pool, new = get_new_blocks(state.pool, lacking)
    table = replace(table, req_to_blocks={**table.req_to_blocks, request_id: blocks + new})
    return _with_table(replace(state, pool=pool), group, table), new


def allocate_mamba_copy(
    state: ManagersState,
    group: int,
    request_id: str,
    num_tokens: int,
    hit: tuple[int, int] | None,
) -> tuple[ManagersState, tuple[int, ...], tuple[int, int] | None]:
    """``allocate_new_blocks`` for a Mamba "align" group whose hits may end inside a block,
    with the state copy it makes (``kvpool.model.mamba_fine.allocate``): ``hit`` is a
    consumer's (block index, source block) when its hit ends inside a block.

    Returns the state, what the worker's table gains, and the (source,
    destination) copy or None.

    Complexity: O(positions appended + keys moved).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(8, hash_block_size=2), [mamba_align(4)])
    >>> m, _ = save_new_computed_blocks(m, 0, "r", [])
    >>> allocate_mamba_copy(m, 0, "r", 7, None)[1:]
    ((0, 1), None)
    """
    spec, table = _group(state, group)
    # Verify that the request is in the group's tables
    _verify_request(table, request_id)
    # Verify that the group is a Mamba "align" group
    if not spec.mamba_align:
        raise UnknownGroup(f'group {group} is not a Mamba "align" group')
    pool, tables, blocks, new, copy = fine.allocate(
        state.pool,
        table.align,
        group,
        spec.block_size,
        request_id,
        table.req_to_blocks[request_id],
        num_tokens,
        hit,
        spec.num_speculative_blocks,
    )
    table = replace(table, align=tables, req_to_blocks={**table.req_to_blocks, request_id: blocks})
    return _with_table(replace(state, pool=pool), group, table), new, copy


def cache_blocks(
    state: ManagersState,
    group: int,
    request: Request,
    num_tokens: int,
    use_eagle: bool = False,
    fine_grained: bool = False,
    mask_alignment: int = 0,
    retention_interval: int | None = None,
    replay: Sequence[int] = (),
    drop_eagle_checkpoint: bool = False,
) -> tuple[ManagersState, None]:
    """Put the request's blocks that are full within its first ``num_tokens`` tokens in the map.

    Only blocks past those already cached, and only as far as the request
    has hashes. Never goes back: a smaller ``num_tokens`` than before
    caches nothing. Mamba groups never cache (their block holds a running
    state, not the KV of the tokens its hash would name). A full-attention
    group whose blocks hold several hash blocks also caches the prompt's
    partial tail (``_cache_prompt_tail``), whether or not hits may end
    inside a block; ``fine_grained`` says they may (the manager's
    ``fine_grained_hits``), which changes what counts as cacheable there.
    A sliding-window group caches only the blocks a hit ending on a multiple of
    ``mask_alignment`` (the scheduler block size) can use
    (``alignment.sliding_window_cache_mask``). Under sparse retention
    (``retention_interval`` not None) it caches only the blocks
    ``retention.sliding_window_retention_mask`` keeps: the segments' tails and
    the windows ending at the ``replay`` boundaries and at the request's
    ``shared_prefix_boundary``; a Mamba "align" group the state blocks
    ``retention.mamba_align_retention_mask`` keeps (segments' last blocks, the
    blocks ending at those boundaries). ``drop_eagle_checkpoint``: the manager runs EAGLE,
    which moves a Mamba "align" group's prompt boundary (``kvpool.model.mamba_align_eagle``).

    Complexity: O(number of blocks newly cached).

    >>> from kvpool.model.pool import new_pool
    >>> from kvpool.model.request import new_request
    >>> m = new_managers(new_pool(4, hash_block_size=2), [full_attention(2)])
    >>> m, _ = save_new_computed_blocks(m, 0, "r", [])
    >>> m, _ = allocate_new_blocks(m, 0, "r", 4)
    >>> m, _ = cache_blocks(m, 0, new_request("r", [7, 8, 9, 9], 2), 4)
    >>> m.tables[0].num_cached_block["r"], len(m.pool.cached)
    (2, 2)
    """
    spec, table = _group(state, group)
    rid = request.request_id
    # Verify that the request is in the group's tables
    _verify_request(table, rid)
    # Verify that the request is hashed in the pool's hash blocks
    verify_hash_block_size(request, state.pool.config.hash_block_size)
    # Verify that the mask's alignment is not negative
    if mask_alignment < 0:
        raise InvalidTokenCount(f"mask_alignment={mask_alignment} is negative")
    # Verify that the retention interval, if any, is not negative
    if retention_interval is not None and retention_interval < 0:
        raise InvalidTokenCount(f"retention_interval={retention_interval} is negative")
    # Verify that the request's shared-prefix boundary is not negative (sparse retention reads it)
    if retention_interval is not None and request.shared_prefix_boundary < 0:
        raise InvalidTokenCount(
            f"shared_prefix_boundary={request.shared_prefix_boundary} is negative"
        )
    # Verify that a recorded checkpoint lies in the request's table (vLLM 0.33 asserts it)
    reserve.verify_checkpoint(table.align, rid, table.req_to_blocks[rid])
    if spec.attention is AttentionType.MAMBA and not spec.mamba_align:
        return state, None
    num_cached = table.num_cached_block[rid]
    num_hashed = len(request.block_hashes) * state.pool.config.hash_block_size
    num_full = min(num_tokens, num_hashed) // spec.block_size
    # a prefill checkpoint where hits may end inside a block (kvpool.model.mamba_fine_reserve)
    fine_checkpoint = (
        spec.mamba_align
        and rid in table.align.checkpoints
        and spec.block_size > state.pool.config.hash_block_size
    )
    recorded: tuple[int, int] | None = None
    if num_cached < num_full:
        mask = None
        if spec.attention is AttentionType.SLIDING_WINDOW and retention_interval is not None:
            mask = sliding_window_retention_mask(
                num_cached,
                num_full,
                mask_alignment or spec.block_size,
                spec.block_size,
                spec.sliding_window,
                use_eagle,
                retention_interval,
                reachable_boundaries(
                    replay, request.shared_prefix_boundary, spec.block_size, use_eagle
                ),
            )
        elif spec.mamba_align and retention_interval is not None:
            mask = mamba_align_retention_mask(
                num_cached,
                num_full,
                mask_alignment or spec.block_size,
                spec.block_size,
                retention_interval,
                reachable_boundaries(
                    replay, request.shared_prefix_boundary, spec.block_size, use_eagle
                ),
            )
        elif spec.attention is AttentionType.SLIDING_WINDOW and mask_alignment:
            mask = sliding_window_cache_mask(
                num_cached,
                num_full,
                mask_alignment,
                spec.block_size,
                spec.sliding_window,
                use_eagle,
            )
        pool, _ = cache_full_blocks(
            state.pool,
            cache_request(request),
            table.req_to_blocks[rid],
            num_cached,
            num_full,
            spec.block_size,
            group,
            mask,
        )
        table = replace(table, num_cached_block={**table.num_cached_block, rid: num_full})
        if fine_checkpoint or (
            spec.mamba_align
            and rid not in table.align.checkpoints
            and spec.block_size <= state.pool.config.hash_block_size
        ):
            # noted after the checkpoint's keys (kvpool.model.mamba_fine_reserve), or the
            # prompt boundary's (mamba_align.cache_prompt_boundary), as vLLM 0.33.0's
            # MambaManager.cache_blocks notes them after _cache_partial_tail_block
            recorded = (num_cached, num_full)
        elif spec.mamba_align:
            blocks = table.req_to_blocks[rid]
            tables = align_mode.record_cached(
                pool, table.align, group, rid, blocks, num_cached, num_full
            )
            table = replace(table, align=tables)
        state = _with_table(replace(state, pool=pool), group, table)
    if fine_checkpoint:
        table = state.tables[group]
        blocks = table.req_to_blocks[rid]
        pool, tables = fine_reserve.cache_checkpoint(
            state.pool,
            table.align,
            group,
            spec.block_size,
            cache_request(request),
            rid,
            blocks,
            request.num_prompt_tokens,
            request.shared_prefix_boundary,
        )
        if recorded is not None:
            tables = align_mode.record_cached(pool, tables, group, rid, blocks, *recorded)
        state = _with_table(replace(state, pool=pool), group, replace(table, align=tables))
    elif spec.mamba_align and rid in state.tables[group].align.checkpoints:
        table = state.tables[group]
        pool, tables = reserve.cache_checkpoint(
            state.pool,
            table.align,
            group,
            spec.block_size,
            cache_request(request),
            rid,
            table.req_to_blocks[rid],
        )
        state = _with_table(replace(state, pool=pool), group, replace(table, align=tables))
    elif spec.mamba_align and spec.block_size > state.pool.config.hash_block_size:
        # hits inside a block (kvpool.model.mamba_fine): the prompt's partial boundary
        table = state.tables[group]
        pool, tables, cached = fine.cache_partial_tail(
            state.pool,
            table.align,
            group,
            spec.block_size,
            cache_request(request),
            rid,
            request.num_prompt_tokens,
            table.req_to_blocks[rid],
            num_tokens,
        )
        table = replace(table, align=tables)
        if cached is not None:
            table = replace(table, num_cached_block={**table.num_cached_block, rid: cached})
        state = _with_table(replace(state, pool=pool), group, table)
    elif spec.mamba_align:
        table = state.tables[group]
        pool, tables = align_mode.cache_prompt_boundary(
            state.pool,
            table.align,
            group,
            spec.block_size,
            cache_request(request),
            request.num_prompt_tokens,
            table.req_to_blocks[rid],
            # several groups: vLLM's hybrid coordinator rounds what it caches to whole blocks,
            # but not for an EAGLE group (kvpool.model.eagle.cacheable_tokens), nor with hits
            # on hash blocks (under decode context parallelism, kvpool.model.align_dcp:
            # vLLM 0.33.0's _align_cacheable leaves the count as it is)
            num_tokens // spec.block_size * spec.block_size
            if len(state.specs) > 1 and not use_eagle and not fine_grained
            else num_tokens,
            drop_eagle_checkpoint,
        )
        if recorded is not None:
            blocks = table.req_to_blocks[rid]
            tables = align_mode.record_cached(pool, tables, group, rid, blocks, *recorded)
        state = _with_table(replace(state, pool=pool), group, replace(table, align=tables))
    if spec.attention is AttentionType.FULL and spec.block_size > state.pool.config.hash_block_size:
        state = _cache_prompt_tail(state, group, request, num_tokens, use_eagle, fine_grained)
    return state, None


def _cache_prompt_tail(
    state: ManagersState,
    group: int,
    request: Request,
    num_tokens: int,
    use_eagle: bool,
    fine_grained: bool,
) -> ManagersState:
    """Key the block where the prompt's last hit-able hash boundary falls inside it.

    A resend of the prompt hits at most ``num_prompt_tokens - 1`` tokens (all
    of them with EAGLE, which drops a hash block after the lookup); the last
    hash-block boundary within that is the boundary. Only what a hit could
    match counts as cacheable: ``num_tokens`` rounded down to the block size
    while hits are block-aligned, so the key arrives when its block is full,
    beside the block's full key; not rounded with EAGLE, nor with
    fine-grained hits (a hit may end at any hash boundary, so the key arrives
    as soon as the boundary's tokens are computed). Nothing happens when the
    boundary is 0, past the cacheable tokens, on a block boundary or past the
    request's blocks; otherwise the pool's ``cache_partial_block`` keys the
    block there (a key it already carries changes nothing). Source: vLLM 0.33.0,
    ``FullAttentionManager.cache_blocks`` and ``_cache_partial_tail_block`` in
    ``vllm/v1/core/single_type_kv_cache_manager.py`` (called on every caching
    of a full-attention group with blocks larger than a hash block), and
    ``HybridKVCacheCoordinator.get_num_cacheable_tokens`` in
    ``vllm/v1/core/kv_cache_coordinator.py`` (the rounding, by
    ``_align_cacheable``, skipped when fine-grained hits are on).

    Complexity: O(keys of the block).
    """
    spec, table = _group(state, group)
    hbs = state.pool.config.hash_block_size
    limit = request.num_prompt_tokens - (0 if use_eagle else 1)
    boundary = min(limit // hbs, len(request.block_hashes)) * hbs
    aligned = not (use_eagle or fine_grained)
    cacheable = num_tokens // spec.block_size * spec.block_size if aligned else num_tokens
    if boundary == 0 or boundary > cacheable or boundary % spec.block_size == 0:
        return state
    blocks = table.req_to_blocks[request.request_id]
    index = boundary // spec.block_size
    if index >= len(blocks):
        return state
    pool, _ = cache_partial_block(
        state.pool, cache_request(request), blocks[index], boundary, group, spec.block_size
    )
    return replace(state, pool=pool)


def free(state: ManagersState, group: int, request_id: str) -> tuple[ManagersState, None]:
    """Release every block of the request in ``group``, last block first.

    Freed in reverse, so the blocks at the tail of a prefix (the least
    likely to be hit again) are evicted first. A request holding nothing
    (aborted before it was allocated) is not an error.

    Complexity: O(number of blocks the request holds).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(4), [full_attention(1)])
    >>> m, _ = save_new_computed_blocks(m, 0, "r", [])
    >>> m, _ = allocate_new_blocks(m, 0, "r", 2)
    >>> free(m, 0, "r")[0].pool.free_queue
    (2, 1, 3)
    """
    _, table = _group(state, group)
    if request_id not in table.req_to_blocks:
        if request_id in table.align.checkpoints:  # recorded by a refused allocation
            table = replace(table, align=align_mode.forget(table.align, request_id))
            return _with_table(state, group, table), None
        return state, None
    blocks = table.req_to_blocks[request_id]
    pool, _ = free_blocks(state.pool, blocks[::-1])
    table = GroupTable(
        req_to_blocks={r: b for r, b in table.req_to_blocks.items() if r != request_id},
        num_cached_block={r: n for r, n in table.num_cached_block.items() if r != request_id},
        align=align_mode.forget(table.align, request_id),
    )
    return _with_table(replace(state, pool=pool), group, table), None


def remove_skipped_blocks(
    state: ManagersState, group: int, request_id: str, num_computed_tokens: int
) -> tuple[ManagersState, None]:
    """Free the blocks no future token of the request attends to; nulls take their place.

    Sliding window: blocks entirely before the window of the next token
    (token ``num_computed_tokens``). Chunked local: blocks of earlier chunks.
    Full attention and whole-request Mamba skip nothing; Mamba "align" releases the
    states before the last computed token's (``kvpool.model.mamba_align.remove_skipped``).
    Blocks are released from the window edge backwards, stopping at the
    first null block (everything before it was released earlier).

    Complexity: O(number of blocks released).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(6), [sliding_window(2, 2)])
    >>> m, _ = save_new_computed_blocks(m, 0, "r", [])
    >>> m, _ = allocate_new_blocks(m, 0, "r", 6)
    >>> remove_skipped_blocks(m, 0, "r", 5)[0].tables[0].req_to_blocks["r"]
    (0, 0, 3)
    """
    spec, table = _group(state, group)
    if request_id not in table.req_to_blocks:
        return state, None
    blocks = table.req_to_blocks[request_id]
    if spec.mamba_align:
        pool, tables, blocks = align_mode.remove_skipped(
            state.pool, table.align, spec.block_size, request_id, blocks, num_computed_tokens
        )
        table = replace(
            table, align=tables, req_to_blocks={**table.req_to_blocks, request_id: blocks}
        )
        return _with_table(replace(state, pool=pool), group, table), None
    if spec.attention is AttentionType.SLIDING_WINDOW:
        first_useful_token = num_computed_tokens - spec.sliding_window + 1
        first_useful = max(0, first_useful_token) // spec.block_size
    elif spec.attention is AttentionType.CHUNKED_LOCAL:
        # Every block of an earlier chunk goes, the last cached one too (vLLM 0.33.0;
        # 0.10.1.1 kept it to read the next event's parent hash from it, which the
        # model reads from the request's hashes).
        chunk = spec.attention_chunk_size
        first_useful = num_computed_tokens // chunk * chunk // spec.block_size
    else:
        return state, None

    table_blocks = list(blocks)
    removed: list[int] = []
    for i in range(min(first_useful, len(blocks)) - 1, -1, -1):
        if table_blocks[i] == NULL_BLOCK_ID:
            break
        removed.append(table_blocks[i])
        table_blocks[i] = NULL_BLOCK_ID
    if not removed:
        return state, None
    pool, _ = free_blocks(state.pool, removed)
    table = replace(table, req_to_blocks={**table.req_to_blocks, request_id: tuple(table_blocks)})
    return _with_table(replace(state, pool=pool), group, table), None


def get_num_common_prefix_blocks(
    state: ManagersState, group: int, request_id: str, num_running_requests: int
) -> int:
    """How many leading blocks of the request every running request shares.

    Full attention only: a block is shared by all when its ref count equals
    ``num_running_requests``. Other types answer 0 (their leading blocks are
    null, or they are not prefixes).

    Complexity: O(number of blocks counted).

    >>> from kvpool.model.pool import new_pool
    >>> m = new_managers(new_pool(4), [full_attention(1)])
    >>> get_num_common_prefix_blocks(m, 0, "r", 1)
    0
    """
    spec, table = _group(state, group)
    if spec.attention is not AttentionType.FULL:
        return 0
    count = 0
    for b in table.req_to_blocks.get(request_id, ()):
        if state.pool.blocks[b].ref_cnt != num_running_requests:
            break
        count += 1
    return count


# --------------------------------------------------------------------------
# Helpers (not operations)
# --------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _reserves(spec: KVCacheSpec) -> bool:
    """Whether the group is Mamba "align" with checkpoint or speculative blocks."""
    return spec.mamba_align and bool(
        spec.num_speculative_blocks or spec.prefill_checkpoint_alignment
    )


def _group(state: ManagersState, group: int) -> tuple[KVCacheSpec, GroupTable]:
    # Verify that the group index names a group
    if not 0 <= group < len(state.specs):
        raise UnknownGroup(f"group {group} is not in 0..{len(state.specs) - 1}")
    return state.specs[group], state.tables[group]


def _verify_request(table: GroupTable, request_id: str) -> None:
    if request_id not in table.req_to_blocks:
        raise UnknownRequest(f"request {request_id!r} holds no blocks in this group")


def _with_table(state: ManagersState, group: int, table: GroupTable) -> ManagersState:
    tables = (*state.tables[:group], table, *state.tables[group + 1 :])
    return replace(state, tables=tables)
