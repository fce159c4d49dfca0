"""The per-group lookup vLLM 0.33 answers a KV connector beside a Mamba "align" group.

With a Mamba group beside full attention, the groups' hits may disagree: the
full-attention blocks of a prefix survive while the Mamba state at its end was
never cached or was evicted (or the other way round). For a request scheduled
with a KV connector vLLM 0.33.0 then looks every group up on its own
(``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``) and answers
full attention's hit, flagging ``hit_diverged`` when some group lags behind it:
the connector may supply the missing state; if it supplies nothing the
scheduler asks ``get_computed_blocks`` again. A group running past full
attention means full attention lost blocks, and the plain lookup answers.

Every group searches up to ``num_tokens - 1`` tokens with hits on multiples
of the scheduler block size, or of the hash block where hits may end inside a
Mamba block (``kvpool.model.mamba_fine``) or inside a sharded full-attention
block under decode context parallelism (``kvpool.model.align_dcp``), groups of
one spec together. The answer: each group's own blocks, untrimmed; full
attention's length (the first full-attention group's); a shared-prefix
boundary of 0; and whether the shortest hit is shorter. Stats record full
attention's length, as for the plain lookup. With EAGLE an EAGLE group (not a Mamba
one) looks one block past that limit and drops its last matched block, as in the
plain lookup.

Sources: ``KVCacheManager.get_computed_blocks_for_connector`` in
``vllm/v1/core/kv_cache_manager.py`` and
``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` /
``verify_and_split_kv_cache_groups`` (``full_attention_group_id``) in
``vllm/v1/core/kv_cache_coordinator.py``, vLLM 0.33.0; docs/semantics.md,
"Mamba in align mode".
"""

from dataclasses import replace

import kvpool.model.copy_on_write as cow
import kvpool.model.eagle as eagle_ops
import kvpool.model.mamba_fine as mamba_fine
import kvpool.model.single_type as single
from kvpool.model.manager import Blocks, KVCacheManagerState, record
from kvpool.model.request import Request, verify_hash_block_size
from kvpool.model.single_type import AttentionType, KVCacheSpec


def applies(state: KVCacheManagerState) -> bool:
    """Whether the connector lookup is per group: caching on, several groups, a Mamba
    "align" group and a full-attention one.

    vLLM 0.33 asks for Mamba layers, a hybrid coordinator and a full-attention group; with
    caching on its Mamba groups are always "align" (``MambaManager.__init__`` asserts it),
    so kvpool's whole-request Mamba keeps the plain lookup.

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.single_type import full_attention, mamba_align
    >>> applies(new_kv_cache_manager(8, [full_attention(4), mamba_align(4)], 64))
    True
    >>> applies(new_kv_cache_manager(8, [mamba_align(4)], 64))
    False
    """
    specs = state.managers.specs
    return (
        state.managers.pool.config.enable_caching
        and len(specs) > 1
        and any(s.mamba_align for s in specs)
        and any(s.attention is AttentionType.FULL for s in specs)
    )


def per_group_hit(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int, int, bool]] | None:
    """The per-group answer, or None where the plain lookup answers (``applies`` is False,
    or some group hit deeper than full attention).

    A request skipping the cache gets nothing and records no stats. Pure.

    Complexity: O(groups * num_tokens / block_size) lookups.

    >>> from kvpool.model.manager import new_kv_cache_manager
    >>> from kvpool.model.request import new_request
    >>> from kvpool.model.single_type import full_attention, mamba_align
    >>> m = new_kv_cache_manager(8, [full_attention(4), mamba_align(4)], 64)
    >>> per_group_hit(m, new_request("r", [1] * 9, 4))[1]
    (((), ()), 0, 0, False)
    """
    if not applies(state):
        return None
    m = state.managers
    # Verify that the request is hashed in the pool's hash blocks
    verify_hash_block_size(request, m.pool.config.hash_block_size)
    specs = m.specs
    empty: Blocks = tuple(() for _ in specs)
    if request.skip_reading_prefix_cache:
        return state, (empty, 0, 0, False)
    fine = state.config.fine_grained_hits
    # with hits inside a Mamba block (kvpool.model.mamba_fine) hits end on hash blocks
    alignment = (
        m.pool.config.hash_block_size
        if fine
        else state.config.scheduler_block_size or specs[0].block_size
    )
    max_length = request.num_tokens - 1
    num_hashed = len(request.block_hashes) * m.pool.config.hash_block_size
    flags = eagle_ops.group_flags(specs, state.config.use_eagle, state.config.eagle_groups)
    kinds: list[tuple[KVCacheSpec, list[int]]] = []
    for g, spec in enumerate(specs):
        for known, ids in kinds:
            if known == spec:
                ids.append(g)
                break
        else:
            kinds.append((spec, [g]))
    hits: dict[int, tuple[int, ...]] = {}
    lengths: dict[int, int] = {}
    for spec, ids in kinds:
        if fine and spec.mamba_align:
            found, length = mamba_fine.find_hit(
                m.pool, spec.block_size, request.block_hashes, max_length, ids
            )
        elif fine and spec.attention is AttentionType.FULL:
            # whole blocks, then into the next block at its highest cached hash boundary
            found = single.find_longest_cache_hit(
                m.pool, spec, request.block_hashes, max_length, ids
            )
            found, length = cow.extend_into_partial_block(
                m.pool, spec, request.block_hashes, max_length, ids, found
            )
        else:
            # an EAGLE kind peeks one block past the limit and drops its last block (a Mamba
            # one does neither: kvpool.model.eagle.peek, kvpool.model.mamba_align_eagle)
            eagle = any(flags[g] for g in ids)
            reach = eagle_ops.peek(spec, max_length, num_hashed) if eagle else max_length
            found = single.find_longest_cache_hit(
                m.pool, spec, request.block_hashes, reach, ids, eagle, alignment
            )
            length = len(found[0]) * spec.block_size
        for g, blocks in zip(ids, found, strict=True):
            hits[g] = blocks
            lengths[g] = length
    full = next(g for g, s in enumerate(specs) if s.attention is AttentionType.FULL)
    num_local = lengths[full]
    if any(length > num_local for length in lengths.values()):
        return None  # full attention lost blocks a lagging group kept: the plain lookup
    if state.stats is not None:
        stats = record(state.stats, request.num_tokens, num_local, request.num_preemptions > 0)
        state = replace(state, stats=stats)
    answer: Blocks = tuple(hits[g] for g in range(len(specs)))
    return state, (answer, num_local, 0, min(lengths.values()) < num_local)
