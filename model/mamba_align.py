"""Mamba in vLLM's "align" cache mode: one state block per block of tokens, cached at boundaries.

A Mamba layer keeps one recurrent state per request, not the KV of every
token. In "align" mode its group's block is as small as the other groups'
(not a whole request), and the block table is indexed by position like
theirs: block ``i`` stands for the state after token ``(i + 1) * block_size``.
Only a few of those positions hold a real block at a time:

* a chunk of prefill or decode that ends in block ``k`` gets at most one new
  block, at index ``k``; the positions it skipped over hold the null block;
* the block of the previous step is kept one more step (the worker copies the
  state out of it into the new one), then released;
* a block whose position is full when the chunk ends holds the state at a
  block boundary, so it is cached under the hash of the tokens up to there:
  a later request with that prefix resumes from it;
* a hit is the *last* cached boundary within the allowed length (search from
  the right): the hit is that one block, with nulls before it.

A state cached this step is not written until the step's forward runs, so a
request that would hit it is refused for this step (the allocation asks for
more blocks than the pool has) and admitted in the next.

Every function is pure: it takes the pool, the group's ``AlignTable`` and the
request's block list, and returns new ones. ``kvpool.model.single_type``
calls them for a group whose spec has ``mamba_align``. What is modelled is
vLLM 0.33.0's ``MambaManager`` with ``mamba_cache_mode == "align"`` (speculative and
prefill checkpoint blocks: ``kvpool.model.mamba_reserve``; blocks of several hash
blocks, whose hits may end inside a block: ``kvpool.model.mamba_fine``; sparse retention:
``kvpool.model.retention``; EAGLE: ``kvpool.model.mamba_align_eagle``); the manager refuses
the rest (``kvpool.model.manager.new_kv_cache_manager``). Source:
``vllm/v1/core/single_type_kv_cache_manager.py`` in vLLM 0.33.0
(``MambaManager.find_longest_cache_hit``, ``get_num_blocks_to_allocate``,
``allocate_new_blocks``, ``remove_skipped_blocks``, ``_remove_blocks_in_range``,
``cache_blocks``, ``pop_blocks_for_free``, ``new_step_starts``);
docs/semantics.md, "Mamba in align mode".
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvpool.model.errors import InvalidTokenCount
from kvpool.model.mamba_align_eagle import prompt_boundary
from kvpool.model.pool import cache_full_blocks, free_blocks, get_cached_block, get_new_blocks
from kvpool.model.state import NULL_BLOCK_ID, BlockHash, CacheRequest, HashKey, PoolState

Offload = tuple[str, int, int, int]
"""A boundary-state hand-off: (request id, group, block id, tokens its state covers)."""


@dataclass(frozen=True)
class AlignTable:
    """What an "align" Mamba group remembers besides the block tables.

    Empty for every other group.
    """

    last_state: Mapping[str, int] = field(default_factory=dict)
    """Request to the index of the block that held its state before the latest allocation
    (vLLM's ``last_state_block_idx``); released once the computed tokens pass it."""
    retired: Mapping[str, int] = field(default_factory=dict)
    """Request to how many leading positions were already released (``_num_retired_blocks``)."""
    allocated: frozenset[str] = frozenset()
    """Requests that went through an allocation (``_allocated_block_reqs``)."""
    cached_this_step: frozenset[HashKey] = frozenset()
    """Keys cached since the step began; a hit ending on one waits for the next step."""
    offloads: tuple[Offload, ...] = ()
    """Boundary states cached and not yet taken by a connector, oldest first."""
    checkpoints: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Request to its prefill checkpoint (tokens, block index) as the latest count recorded
    it (vLLM's ``_checkpoints``; ``kvpool.model.mamba_reserve``)."""
    partial_hits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Request to (block index, source block) of a state it keyed inside a block and must copy
    at its next allocation (vLLM's ``_partial_hit_reqs``; ``kvpool.model.mamba_fine``)."""
    producer_tails: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Request to (source block, boundary tokens) of that state, offered once copied
    (``_producer_partial_tail_reqs``; ``kvpool.model.mamba_fine``)."""


def find_hit(
    pool: PoolState,
    block_size: int,
    hashes: Sequence[BlockHash],
    max_length: int,
    group_ids: Sequence[int],
    alignment: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """The last block within ``max_length`` tokens every group has cached, nulls before it.

    ``hashes`` are at ``block_size``. One tuple per group of ``group_ids``;
    all empty when no boundary is cached. With an ``alignment`` (a multiple of
    ``block_size``: the scheduler block of several groups) only a block ending
    on a multiple of it is a hit, as in vLLM 0.33.0's ``MambaManager.find_longest_cache_hit``.

    Complexity: O(max_length / block_size * len(group_ids)).

    >>> from kvpool.model.pool import new_pool
    >>> find_hit(new_pool(4), 2, [b"a", b"b"], 4, [0])
    ((),)
    """
    # Verify that the length is not negative
    if max_length < 0:
        raise InvalidTokenCount(f"max_length={max_length} is negative")
    for i in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
        if alignment and (i + 1) * block_size % alignment:
            continue
        found = get_cached_block(pool, hashes[i], group_ids)
        if found is not None:
            return tuple((NULL_BLOCK_ID,) * i + (b,) for b in found)
    return tuple(() for _ in group_ids)


def num_blocks_to_allocate(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    held: Sequence[int],
    num_tokens: int,
    hits: Sequence[int],
) -> int:
    """Free blocks an allocation for ``num_tokens`` main-model tokens takes in the group.

    At most one new block (the one the chunk ends in), none if the table
    already reaches that far, plus the hits that are free now. A hit ending
    on a state cached this step asks for more blocks than the pool has, so
    the request waits a step. The count is not clamped at zero: a table
    longer than needed makes it negative, and the manager's sum over groups
    goes down by that much (vLLM 0.33.0 does the same).

    Complexity: O(len(hits)).

    >>> from kvpool.model.pool import new_pool
    >>> num_blocks_to_allocate(new_pool(8), AlignTable(), 2, (), 7, ())
    1
    """
    if hits:
        key = pool.blocks[hits[-1]].block_hash
        if key is not None and key in table.cached_this_step:
            return pool.config.num_blocks + 1
    lacking = -(-num_tokens // block_size) - len(hits) - len(held)
    if lacking > 0:
        lacking = 1
    evictable = sum(1 for b in hits if b != NULL_BLOCK_ID and pool.blocks[b].ref_cnt == 0)
    return lacking + evictable


def allocate(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    request_id: str,
    blocks: tuple[int, ...],
    num_tokens: int,
) -> tuple[PoolState, AlignTable, tuple[int, ...], tuple[int, ...]]:
    """Extend the request's table to the block ``num_tokens`` ends in: nulls, then one new block.

    Returns the pool, the table, the request's blocks and what was appended
    (the nulls too: the worker's block table is positional). The block that
    held the state until now is remembered, to release once it is passed.
    A table already long enough gains nothing.

    Complexity: O(positions appended).

    >>> from kvpool.model.pool import new_pool
    >>> allocate(new_pool(8), AlignTable(), 2, "r", (), 7)[3]
    (0, 0, 0, 1)
    """
    required = -(-num_tokens // block_size)
    allocated = table.allocated | {request_id}
    if required <= len(blocks):
        return pool, replace(table, allocated=allocated), blocks, ()
    last_state = dict(table.last_state)
    if request_id in table.allocated or blocks:
        last_state[request_id] = len(blocks) - 1
    pool, new = get_new_blocks(pool, 1)
    appended = (NULL_BLOCK_ID,) * (required - 1 - len(blocks)) + new
    table = replace(table, last_state=last_state, allocated=allocated)
    return pool, table, blocks + appended, appended


def remove_skipped(
    pool: PoolState,
    table: AlignTable,
    block_size: int,
    request_id: str,
    blocks: tuple[int, ...],
    num_computed_tokens: int,
) -> tuple[PoolState, AlignTable, tuple[int, ...]]:
    """Release the states the request no longer needs: every block before the last computed token's.

    Positions below the request's retired mark were released before and
    are not visited again; the rest, up to the block of the last computed
    token, are released last first, nulls passed over. Then the block that
    held the previous step's state goes too, once the computed tokens are
    past its block.

    Complexity: O(positions released).

    >>> from kvpool.model.pool import new_pool
    >>> pool, ids = get_new_blocks(new_pool(8), 2)
    >>> remove_skipped(pool, AlignTable(), 2, "r", ids, 3)[2]
    (0, 2)
    """
    row = list(blocks)
    retired = dict(table.retired)
    skipped = min((num_computed_tokens - 1) // block_size, len(row))
    first = retired.get(request_id, 0)
    if num_computed_tokens > 1 and first < skipped:
        freed = [row[i] for i in range(skipped - 1, first - 1, -1) if row[i] != NULL_BLOCK_ID]
        for i in range(first, skipped):
            row[i] = NULL_BLOCK_ID
        pool, _ = free_blocks(pool, freed)
        retired[request_id] = skipped
    last = table.last_state.get(request_id)
    if (
        last is not None
        and last < -(-num_computed_tokens // block_size) - 1
        and row[last] != NULL_BLOCK_ID
    ):
        pool, _ = free_blocks(pool, [row[last]])
        row[last] = NULL_BLOCK_ID
    return pool, replace(table, retired=retired), tuple(row)


def record_cached(
    pool: PoolState,
    table: AlignTable,
    group: int,
    request_id: str,
    blocks: Sequence[int],
    first: int,
    stop: int,
) -> AlignTable:
    """Note the states just cached at positions ``first..stop``: cached this step, and offered.

    Nulls and blocks left without a key are passed over.

    Complexity: O(stop - first).

    >>> from kvpool.model.pool import new_pool
    >>> record_cached(new_pool(4), AlignTable(), 0, "r", (0,), 0, 1) == AlignTable()
    True
    """
    keys = set(table.cached_this_step)
    offloads = list(table.offloads)
    for i in range(first, stop):
        state = pool.blocks[blocks[i]]
        if blocks[i] == NULL_BLOCK_ID or state.block_hash is None:
            continue
        keys.add(state.block_hash)
        offloads.append((request_id, group, blocks[i], state.hash_num_tokens or 0))
    return replace(table, cached_this_step=frozenset(keys), offloads=tuple(offloads))


def cache_prompt_boundary(
    pool: PoolState,
    table: AlignTable,
    group: int,
    block_size: int,
    request: CacheRequest,
    num_prompt_tokens: int,
    blocks: Sequence[int],
    num_tokens: int,
    drop_eagle: bool = False,
) -> tuple[PoolState, AlignTable]:
    """Key the state at the prompt's last reusable boundary again if its block lost its key.

    The boundary is the last block boundary before the prompt's last token (a
    resend of the prompt recomputes that token); with EAGLE (``drop_eagle``) one
    block below the last boundary within the prompt
    (``kvpool.model.mamba_align_eagle.prompt_boundary``). When caching reaches exactly
    there and the request's block at that position holds the state but carries
    no key for it (``evict_blocks`` took it), the block is keyed again, and the
    key counts as cached this step. Anything else changes nothing: the full
    block was keyed when its position filled, and a null has no state.

    Complexity: O(1).

    >>> from kvpool.model.pool import new_pool
    >>> req = CacheRequest((b"a", b"ab"))
    >>> cache_prompt_boundary(new_pool(4), AlignTable(), 0, 2, req, 5, (0, 0), 3)[1]
    AlignTable(last_state={}, retired={}, allocated=frozenset(), cached_this_step=frozenset(), \
offloads=(), checkpoints={}, partial_hits={}, producer_tails={})
    """
    boundary = prompt_boundary(num_prompt_tokens, block_size, drop_eagle)
    index = num_tokens // block_size - 1
    if num_tokens <= 0 or num_tokens != boundary or index >= len(blocks):
        return pool, table
    block = blocks[index]
    if block == NULL_BLOCK_ID or pool.blocks[block].hash_num_tokens == num_tokens:
        return pool, table
    pool, _ = cache_full_blocks(pool, request, blocks, index, index + 1, block_size, group)
    key = pool.blocks[block].block_hash
    if key is not None:
        table = replace(table, cached_this_step=table.cached_this_step | {key})
    return pool, table


def forget(table: AlignTable, request_id: str) -> AlignTable:
    """The table without anything about the request, its offers not yet taken included.

    >>> forget(AlignTable(allocated=frozenset({"r"})), "r") == AlignTable()
    True
    """
    return replace(
        table,
        last_state={r: i for r, i in table.last_state.items() if r != request_id},
        retired={r: i for r, i in table.retired.items() if r != request_id},
        allocated=table.allocated - {request_id},
        offloads=tuple(o for o in table.offloads if o[0] != request_id),
        checkpoints={r: c for r, c in table.checkpoints.items() if r != request_id},
        partial_hits={r: h for r, h in table.partial_hits.items() if r != request_id},
        producer_tails={r: t for r, t in table.producer_tails.items() if r != request_id},
    )


def new_step(table: AlignTable) -> AlignTable:
    """A scheduler step begins: states cached in the last one are written by now.

    >>> new_step(AlignTable(cached_this_step=frozenset({(b"h", 0)}))) == AlignTable()
    True
    """
    return replace(table, cached_this_step=frozenset())


def take_offloads(table: AlignTable) -> tuple[AlignTable, tuple[Offload, ...]]:
    """The boundary states offered since the last call, oldest first, and forget them.

    >>> take_offloads(AlignTable(offloads=(("r", 0, 3, 4),)))[1]
    (('r', 0, 3, 4),)
    """
    return replace(table, offloads=()), table.offloads


def take_boundary_state_offloads(
    tables: Sequence[AlignTable],
) -> tuple[tuple[AlignTable, ...], dict[str, tuple[tuple[int, int, int], ...]]]:
    """Every group's offers drained, by request: ``{request: ((group, block, tokens), ...)}``.

    Groups in order, each group's offers oldest first (vLLM 0.33.0,
    ``KVCacheManager.take_boundary_state_offloads`` in
    ``vllm/v1/core/kv_cache_manager.py``). The manager's
    ``take_boundary_state_offloads`` is this over its groups' ``align`` tables.

    >>> take_boundary_state_offloads([AlignTable(offloads=(("r", 1, 3, 4),))])[1]
    {'r': ((1, 3, 4),)}
    """
    drained: list[AlignTable] = []
    offers: dict[str, tuple[tuple[int, int, int], ...]] = {}
    for table in tables:
        table, taken = take_offloads(table)
        drained.append(table)
        for request_id, group, block, tokens in taken:
            offers[request_id] = (*offers.get(request_id, ()), (group, block, tokens))
    return tuple(drained), offers


def finalize_partial_tail_offloads(tables: Sequence[AlignTable], request_id: str) -> tuple[()]:
    """The producer partial tails a finishing request hands off with blocks of one hash
    block: none.

    vLLM 0.33.0 records a producer tail only when a prompt boundary falls
    inside a Mamba block (hash blocks smaller than the block:
    ``kvpool.model.mamba_fine.finalize``).

    >>> finalize_partial_tail_offloads([AlignTable()], "r")
    ()
    """
    return ()
