"""vLLM 0.33's further scheduler calls: the deferred free, and what a KV connector asks for.

vLLM 0.33's scheduler may free a request's blocks only once no step in flight
can still write them: ``pop_blocks_for_free`` takes the request out of every
group's tables and hands its blocks back, still held, for the scheduler to
release later through the pool (``free_blocks``, last block first). With a KV
connector it also cuts the block table at the computed tokens
(``remove_skipped_blocks``, ``get_block_ids_for_computed_tokens``), looks up
hits per group (``get_computed_blocks_for_connector``), re-records blocks for
zeroing after a failed load (``record_blocks_for_zeroing``), and collects the
Mamba "align" states to offload (``take_boundary_state_offloads``,
``finalize_partial_tail_offloads``).

Three of these differ from the plain calls only with Mamba "align" groups
(``kvpool.model.mamba_align``), each through one function below:
``_pending_boundary_states`` drains the "align" groups' offers;
``_partial_tail`` answers the plain result, because what would make it
differ (a prompt boundary inside a Mamba block) is not modelled
(docs/limits.md); ``_per_group_hit`` looks each group up on its own
(``kvpool.model.per_group_hit``).

Sources: ``vllm/v1/core/kv_cache_manager.py``, ``kv_cache_coordinator.py`` and
``single_type_kv_cache_manager.py`` in vLLM 0.33.0; docs/semantics.md, "The
request layer".
"""

from dataclasses import replace

import kvpool.model.mamba_align as mamba_align
import kvpool.model.mamba_fine as mamba_fine
import kvpool.model.per_group_hit as per_group_hit
import kvpool.model.single_type as single
from kvpool.model.errors import HiSparseNotModelled, InvalidTokenCount
from kvpool.model.manager import (
    Blocks,
    KVCacheManagerState,
    get_computed_blocks_with_boundary,
    records_new_block_ids,
)
from kvpool.model.request import Request
from kvpool.model.single_type import AttentionType
from kvpool.model.state import NULL_BLOCK_ID

BoundaryOffloads = dict[str, tuple[tuple[int, int, int], ...]]
"""Per request id, the (group, block, boundary tokens) of each Mamba state to offload."""


# --------------------------------------------------------------------------
# The deferred free
# --------------------------------------------------------------------------


def pop_blocks_for_free(
    state: KVCacheManagerState, request_id: str
) -> tuple[KVCacheManagerState, tuple[int, ...]]:
    """Take the request out of every group's tables and return its blocks, still held.

    The blocks come group by group, each group's in allocation order without
    its leading null blocks (a window's skipped prefix). Nothing is released:
    the caller frees them later with ``free_blocks``, last first, as ``free``
    would have. A request holding nothing gives ``()``.

    Complexity: O(blocks the request holds).

    >>> from kvpool.model.manager import allocate_slots, new_kv_cache_manager, num_free_blocks
    >>> from kvpool.model.request import new_request
    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> m, _ = allocate_slots(m, new_request("r", [1, 2, 3], 2), 3)
    >>> m, blocks = pop_blocks_for_free(m, "r")
    >>> blocks, num_free_blocks(m)
    ((1, 2), 1)
    """
    # Verify that the blocks are of one pool (kvpool.model.hisparse.pop_blocks_for_free
    # names each block with its pool)
    if state.config.hisparse is not None:
        raise HiSparseNotModelled(
            "HiSparse blocks are of two pools: use kvpool.model.hisparse.pop_blocks_for_free"
        )
    m = state.managers
    popped: list[int] = []
    tables = []
    for table in m.tables:
        blocks = table.req_to_blocks.get(request_id, ())
        head = 0
        while head < len(blocks) and blocks[head] == NULL_BLOCK_ID:
            head += 1
        popped.extend(blocks[head:])
        tables.append(
            single.GroupTable(
                req_to_blocks={r: b for r, b in table.req_to_blocks.items() if r != request_id},
                num_cached_block={
                    r: n for r, n in table.num_cached_block.items() if r != request_id
                },
                # an "align" group forgets the request's states and offers, as free does
                align=mamba_align.forget(table.align, request_id),
            )
        )
    if not any(request_id in t.req_to_blocks for t in m.tables):
        return replace(state, managers=replace(m, tables=tuple(tables))), ()
    return replace(state, managers=replace(m, tables=tuple(tables))), tuple(popped)


# --------------------------------------------------------------------------
# A KV connector's calls
# --------------------------------------------------------------------------


def remove_skipped_blocks(
    state: KVCacheManagerState, request_id: str, processed_computed_tokens: int
) -> tuple[KVCacheManagerState, None]:
    """Free, in every group, the request's blocks no token after the first
    ``processed_computed_tokens`` attends to (``allocate_slots`` does the same first).

    Sliding window: blocks before the window of the next token; chunked local:
    blocks of earlier chunks; full attention and Mamba: none. A request holding
    nothing is not an error.

    Complexity: O(blocks released).

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> remove_skipped_blocks(m, "r", 4)[0] == m
    True
    """
    # Verify that the count is not negative
    if processed_computed_tokens < 0:
        raise InvalidTokenCount(
            f"processed_computed_tokens={processed_computed_tokens} is negative"
        )
    m = state.managers
    for g in range(len(m.specs)):
        m, _ = single.remove_skipped_blocks(m, g, request_id, processed_computed_tokens)
    return replace(state, managers=m), None


def get_block_ids_for_computed_tokens(
    state: KVCacheManagerState, request_id: str, num_computed_tokens: int
) -> Blocks:
    """The request's block table cut, in each attention group, to the blocks holding its first
    ``num_computed_tokens`` tokens; a Mamba group's table whole (its block is a state, not
    positions). Pure.

    The cut counts the spec's own block size, as vLLM 0.33.0's
    ``KVCacheManager.get_block_ids_for_computed_tokens`` reads ``kv_cache_spec.block_size``:
    with decode context parallelism a sharded group's blocks hold ``dcp_world_size`` times
    that in the manager (``kvpool.model.geometry``), so the cut keeps more blocks than the
    tokens fill (docs/semantics.md, "Block geometry").

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.single_type import full_attention
    >>> get_block_ids_for_computed_tokens(new_kv_cache_manager(4, [full_attention(2)], 8), "r", 2)
    ((),)
    """
    # Verify that the count is not negative
    if num_computed_tokens < 0:
        raise InvalidTokenCount(f"num_computed_tokens={num_computed_tokens} is negative")
    dcp = state.config.dcp_world_size
    out: list[tuple[int, ...]] = []
    for spec, table in zip(state.managers.specs, state.managers.tables, strict=True):
        blocks = table.req_to_blocks.get(request_id, ())
        if spec.attention is not AttentionType.MAMBA:
            # the spec's block size: a sharded group's manager block over the decode ranks
            size = spec.block_size // dcp if spec.dcp_sharded else spec.block_size
            blocks = blocks[: -(-num_computed_tokens // size)]
        out.append(blocks)
    return tuple(out)


def get_computed_blocks_for_connector(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int, int, bool]]:
    """The lookup for a request scheduled with a KV connector: ``get_computed_blocks_with_boundary``
    and whether the per-group hits diverged (``hit_diverged``).

    vLLM 0.33 looks each group up on its own only in a hybrid with Mamba and
    full attention and prefix caching on, where the groups' hits may disagree;
    ``_per_group_hit`` is that path (``kvpool.model.per_group_hit``). Elsewhere,
    and where a group hit deeper than full attention, the plain lookup is the
    answer, with ``False``.

    Complexity: that of ``find_hit``.

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.request import new_request
    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> get_computed_blocks_for_connector(m, new_request("r", [1, 2, 3], 2))[1]
    (((),), 0, 0, False)
    """
    per_group = _per_group_hit(state, request)
    if per_group is not None:
        return per_group
    state, (blocks, num_tokens, boundary) = get_computed_blocks_with_boundary(state, request)
    return state, (blocks, num_tokens, boundary, False)


def _per_group_hit(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int, int, bool]] | None:
    """Seam for Mamba "align": the per-group lookup where it differs from the plain one
    (``kvpool.model.per_group_hit``; None: the plain lookup answers)."""
    return per_group_hit.per_group_hit(state, request)


def record_blocks_for_zeroing(
    state: KVCacheManagerState, request_id: str, start_token: int
) -> tuple[KVCacheManagerState, None]:
    """Record again for zeroing the request's blocks from ``start_token`` on, in every group
    whose new blocks are recorded (``manager.records_new_block_ids``), e.g. blocks a failed
    KV load left unwritten. Other groups, and a request holding nothing, change nothing.

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> record_blocks_for_zeroing(m, "r", 0)[0] == m
    True
    """
    specs = state.managers.specs
    recording = [g for g in range(len(specs)) if records_new_block_ids(specs, g)]
    for g in recording:
        size = specs[g].block_size
        # Verify that zeroing starts at a block boundary (a partly valid block would lose its
        # valid prefix)
        if start_token < 0 or start_token % size != 0:
            raise InvalidTokenCount(
                f"start_token={start_token} is not a block boundary of group {g} ({size} tokens)"
            )
    zero = state.new_block_ids
    for g in recording:
        blocks = state.managers.tables[g].req_to_blocks.get(request_id, ())
        zero = (*zero, *((g, b) for b in blocks[start_token // specs[g].block_size :]))
    return replace(state, new_block_ids=zero), None


def take_boundary_state_offloads(
    state: KVCacheManagerState,
) -> tuple[KVCacheManagerState, BoundaryOffloads]:
    """This step's Mamba boundary states for a connector to offload, per request, and forget
    them. Only Mamba "align" groups record any (``_pending_boundary_states``).

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.single_type import full_attention
    >>> take_boundary_state_offloads(new_kv_cache_manager(4, [full_attention(2)], 8))[1]
    {}
    """
    return _pending_boundary_states(state)


def _pending_boundary_states(
    state: KVCacheManagerState,
) -> tuple[KVCacheManagerState, BoundaryOffloads]:
    """Take the committed boundary states of the Mamba "align" groups (vLLM 0.33.0
    ``take_pending_boundary_state_offloads``), grouped by request in the order recorded
    (``kvpool.model.mamba_align``); other groups record none."""
    m = state.managers
    drained, offers = mamba_align.take_boundary_state_offloads([t.align for t in m.tables])
    tables = tuple(replace(t, align=a) for t, a in zip(m.tables, drained, strict=True))
    return replace(state, managers=replace(m, tables=tables)), offers


def finalize_partial_tail_offloads(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[tuple[int, int, int], ...]]:
    """When a request finishes, the (group, block, boundary tokens) of each partial-tail Mamba
    state that is safe to offload (``_partial_tail``, group by group): ``()`` in every
    configuration kvpool models.

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.request import new_request
    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> finalize_partial_tail_offloads(m, new_request("r", [1, 2], 2))[1]
    ()
    """
    found: list[tuple[int, int, int]] = []
    for g in range(len(state.managers.specs)):
        state, tail = _partial_tail(state, g, request)
        if tail is not None:
            found.append(tail)
    return state, tuple(found)


def _partial_tail(
    state: KVCacheManagerState, group: int, request: Request
) -> tuple[KVCacheManagerState, tuple[int, int, int] | None]:
    """The group's producer partial tail of the request, consumed, if no later token was
    forwarded (vLLM 0.33.0 ``finalize_partial_tail_offload``). Only a Mamba "align" group
    whose prompt boundary fell inside a block has one (``kvpool.model.mamba_fine.finalize``);
    the model schedules nothing ahead, so no token is in flight."""
    m = state.managers
    table = m.tables[group]
    align, tail = mamba_fine.finalize(
        table.align, group, request.request_id, request.num_computed_tokens, 0
    )
    if align is table.align:
        return state, tail
    tables = (*m.tables[:group], replace(table, align=align), *m.tables[group + 1 :])
    return replace(state, managers=replace(m, tables=tables)), tail
