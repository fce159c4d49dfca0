"""The KV cache manager: what a scheduler asks of the KV cache, one pure function per call.

The scheduler asks three things per request: which of its blocks are
already cached (``get_computed_blocks``), whether there is room for the
tokens it wants to compute this step (``allocate_slots``, which takes the
hits, allocates, and caches the blocks that become full), and to release
everything when the request finishes or is preempted (``free``). Every KV
cache group has its own single-type manager (``kvpool.model.single_type``);
all groups share one block pool.

Block layout of one request in one group, as ``allocate_slots`` sees it::

    | computed | new computed (hits) | new | lookahead |
    |<------------- slots needed (capped at max_model_len) --->|
    |<----- cached afterwards: full blocks of ------>|
          (computed + hits + new, capped at the request's tokens)

Semantics: seed ``004_1e64ab4c99d140d3.txt`` (allocate_slots, free,
get_computed_blocks), seed ``002`` (the single-type managers), seed ``001``
(prefix-caching metrics); docs/semantics.md, "The request layer", records
what decided the rest.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import kvpool.model.pool as pool_ops
import kvpool.model.single_type as single
from kvpool.model.errors import (
    CachingDisabled,
    HitOnRunningRequest,
    InvalidHit,
    InvalidManagerConfig,
    InvalidTokenCount,
    NoNewTokens,
    UnknownBlock,
)
from kvpool.model.events import KVCacheEvent
from kvpool.model.profiles import DEFAULT_PROFILE, Profile
from kvpool.model.request import Request, verify_hash_block_size
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.model.state import BlockHash

Blocks = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group: ``blocks[g][i]`` is block i of group g."""

# --------------------------------------------------------------------------
# Prefix-cache statistics
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixCacheStats:
    """Hit statistics gathered since the scheduler last took them.

    ``queries`` and ``hits`` count tokens. Requests seen again after a
    preemption are counted apart (``preempted_*``).
    """

    reset: bool = False
    """reset_prefix_cache succeeded since the stats were last taken."""
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


def record(
    stats: PrefixCacheStats, num_tokens: int, num_hits: int, preempted: bool
) -> PrefixCacheStats:
    """The stats with one more lookup of ``num_tokens`` tokens, ``num_hits`` of them hit.

    >>> record(PrefixCacheStats(), 8, 4, preempted=False).hits
    4
    """
    if preempted:
        return replace(
            stats,
            preempted_requests=stats.preempted_requests + 1,
            preempted_queries=stats.preempted_queries + num_tokens,
            preempted_hits=stats.preempted_hits + num_hits,
        )
    return replace(
        stats,
        requests=stats.requests + 1,
        queries=stats.queries + num_tokens,
        hits=stats.hits + num_hits,
    )


@dataclass(frozen=True)
class PrefixCachingMetrics:
    """The hit rate over (about) the last ``max_recent_requests`` requests.

    ``window`` holds one (requests, queries, hits) entry per observed batch,
    oldest first; the totals are their sums.
    """

    max_recent_requests: int = 1000
    window: tuple[tuple[int, int, int], ...] = ()
    requests: int = 0
    queries: int = 0
    hits: int = 0


def observe(metrics: PrefixCachingMetrics, stats: PrefixCacheStats) -> PrefixCachingMetrics:
    """Add one batch of stats; drop the oldest batches while more than N requests are counted.

    A reset in the stats empties the window first. A batch of no requests
    is not added. The newest batch is always kept, even if it alone
    exceeds N requests.

    Complexity: O(number of batches dropped).

    >>> m = observe(PrefixCachingMetrics(2), record(PrefixCacheStats(), 4, 2, False))
    >>> m = observe(m, record(record(PrefixCacheStats(), 4, 4, False), 4, 0, False))
    >>> hit_rate(m), m.requests
    (0.5, 2)
    """
    # Verify that the window holds at least one request
    if metrics.max_recent_requests < 1:
        raise InvalidManagerConfig("max_recent_requests must be at least 1")
    if stats.reset:
        metrics = PrefixCachingMetrics(metrics.max_recent_requests)
    if stats.requests == 0:
        return metrics
    window = (*metrics.window, (stats.requests, stats.queries, stats.hits))
    requests = metrics.requests + stats.requests
    queries = metrics.queries + stats.queries
    hits = metrics.hits + stats.hits
    while len(window) > 1 and requests > metrics.max_recent_requests:
        (r, q, h), window = window[0], window[1:]
        requests, queries, hits = requests - r, queries - q, hits - h
    return PrefixCachingMetrics(metrics.max_recent_requests, window, requests, queries, hits)


def hit_rate(metrics: PrefixCachingMetrics) -> float:
    """Hit tokens over queried tokens in the window; 0.0 when nothing was queried.

    >>> hit_rate(PrefixCachingMetrics())
    0.0
    """
    return 0.0 if metrics.queries == 0 else metrics.hits / metrics.queries


# --------------------------------------------------------------------------
# The manager's state
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ManagerConfig:
    """The manager's parameters besides the pool's and the groups'."""

    max_model_len: int
    use_eagle: bool = False
    log_stats: bool = False


@dataclass(frozen=True)
class KVCacheManagerState:
    """A whole KV cache manager: its groups, the pool they share, and the hit stats."""

    config: ManagerConfig
    managers: single.ManagersState
    stats: PrefixCacheStats | None = None
    """None unless log_stats."""


def new_kv_cache_manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec],
    max_model_len: int,
    hash_block_size: int | None = None,
    enable_caching: bool = True,
    use_eagle: bool = False,
    log_stats: bool = False,
    enable_events: bool = False,
    profile: Profile = DEFAULT_PROFILE,
) -> KVCacheManagerState:
    """A manager over a fresh pool of ``num_blocks``, one group per spec.

    ``hash_block_size`` defaults to the first group's block size. Groups
    must share one block size; a Mamba group's block must hold a whole
    request (``block_size >= max_model_len``); EAGLE is supported with one
    group of full attention or sliding window.

    Complexity: O(num_blocks + len(specs)).

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(8, [full_attention(4)], max_model_len=32)
    >>> usage(m)
    0.0
    """
    # Verify that requests can hold at least one token
    if max_model_len < 1:
        raise InvalidManagerConfig(f"max_model_len={max_model_len} must be positive")
    # Verify that there is at least one group, all with one block size
    if not specs or len({s.block_size for s in specs}) != 1:
        raise InvalidManagerConfig("the groups must be at least one and share one block size")
    hbs = specs[0].block_size if hash_block_size is None else hash_block_size
    # Verify that a Mamba block holds a whole request
    for spec in specs:
        if spec.attention is AttentionType.MAMBA and spec.block_size < max_model_len:
            raise InvalidManagerConfig(
                f"a Mamba block of {spec.block_size} tokens cannot hold {max_model_len} tokens"
            )
    # Verify that EAGLE runs with a single full-attention or sliding-window group
    if use_eagle and (
        len(specs) != 1
        or specs[0].attention not in (AttentionType.FULL, AttentionType.SLIDING_WINDOW)
    ):
        raise InvalidManagerConfig("EAGLE needs one group of full attention or sliding window")
    try:
        pool = pool_ops.new_pool(num_blocks, enable_caching, hbs, enable_events, profile)
    except ValueError as error:
        raise InvalidManagerConfig(str(error)) from error
    return KVCacheManagerState(
        config=ManagerConfig(max_model_len, use_eagle, log_stats),
        managers=single.new_managers(pool, specs),
        stats=PrefixCacheStats() if log_stats else None,
    )


# --------------------------------------------------------------------------
# The scheduler's calls
# --------------------------------------------------------------------------


def find_hit(
    state: KVCacheManagerState, block_hashes: Sequence[BlockHash], max_length: int
) -> tuple[Blocks, int]:
    """The longest prefix of at most ``max_length`` tokens every group has cached.

    One group: its own search. Several: each attention type in turn (full
    attention first) may only shorten the candidate length; repeat until no
    type shortens it, then trim full-attention hits to that length.

    Complexity: O(groups * max_length / block_size) lookups per round.

    >>> from kvpool.model.single_type import full_attention
    >>> find_hit(new_kv_cache_manager(4, [full_attention(2)], 8), [b"x"], 3)
    (((),), 0)
    """
    m = state.managers
    specs = m.specs
    eagle = state.config.use_eagle
    if len(specs) == 1:
        (hit,) = single.find_longest_cache_hit(
            m.pool, specs[0], block_hashes, max_length, [0], eagle
        )
        return (hit,), len(hit) * specs[0].block_size

    kinds: list[tuple[KVCacheSpec, list[int]]] = []
    for g, spec in enumerate(specs):
        for known, ids in kinds:
            if known == spec:
                ids.append(g)
                break
        else:
            kinds.append((spec, [g]))
    kinds.sort(key=lambda k: k[0].attention is not AttentionType.FULL)

    hits: dict[int, tuple[int, ...]] = {}
    length = max_length
    while True:
        candidate = length
        for spec, ids in kinds:
            if spec.attention is AttentionType.FULL and ids[0] in hits:
                candidate = min(candidate, len(hits[ids[0]]) * spec.block_size)
                continue
            found = single.find_longest_cache_hit(m.pool, spec, block_hashes, candidate, ids, False)
            for g, blocks in zip(ids, found, strict=True):
                hits[g] = blocks
            candidate = len(found[0]) * spec.block_size
        if candidate >= length:
            break
        length = candidate
    block_size = specs[0].block_size
    trimmed = tuple(hits[g][: -(-length // block_size)] for g in range(len(specs)))
    return trimmed, length


def get_computed_blocks(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int]]:
    """The cached blocks the request may reuse and how many tokens they cover.

    At most ``num_tokens - 1`` tokens hit: the last token is always
    computed, for its logits. Nothing hits when caching is off or the
    request skips reading the cache; only real lookups are counted in the
    stats.

    Complexity: that of ``find_hit``.

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> get_computed_blocks(m, new_request("r", [1, 2, 3], 2))[1]
    (((),), 0)
    """
    # Verify that the request is hashed in the pool's hash blocks
    verify_hash_block_size(request, state.managers.pool.config.hash_block_size)
    empty: Blocks = tuple(() for _ in state.managers.specs)
    if not state.managers.pool.config.enable_caching or request.skip_reading_prefix_cache:
        return state, (empty, 0)
    blocks, num_tokens = find_hit(state, request.block_hashes, request.num_tokens - 1)
    if state.stats is not None:
        stats = record(state.stats, request.num_tokens, num_tokens, request.num_preemptions > 0)
        state = replace(state, stats=stats)
    return state, (blocks, num_tokens)


def allocate_slots(
    state: KVCacheManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Blocks | None = None,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
) -> tuple[KVCacheManagerState, Blocks | None]:
    """Give the request slots for ``num_new_tokens`` more tokens (and look-ahead), or refuse.

    In this order: free the blocks that left every group's attention window
    (even if the call is then refused); count the blocks needed, cache hits
    that are free now included; refuse with None if the pool has fewer
    free blocks, changing nothing else; take the hits (touch), record them,
    append new blocks; then cache every block that is full within the
    computed, hit and new tokens, never past the request's own tokens
    (draft tokens are not final). Returns the new blocks per group.

    Complexity: O(blocks touched, allocated, released or cached).

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> allocate_slots(m, new_request("r", [1, 2, 3], 2), 3)[1]
    ((1, 2),)
    """
    m = state.managers
    groups = range(len(m.specs))
    rid = request.request_id
    hits: Blocks = tuple(() for _ in groups) if new_computed_blocks is None else new_computed_blocks
    # Verify that the request is hashed in the pool's hash blocks
    verify_hash_block_size(request, m.pool.config.hash_block_size)
    # Verify that at least one new token is asked for
    if num_new_tokens <= 0:
        raise NoNewTokens(f"num_new_tokens must be positive, got {num_new_tokens}")
    # Verify that the other counts are not negative
    if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
        raise InvalidTokenCount("num_new_computed_tokens and num_lookahead_tokens must be >= 0")
    # Verify that the hits have one entry per group, of known blocks
    if len(hits) != len(m.specs):
        raise InvalidHit(f"{len(hits)} hit lists for {len(m.specs)} groups")
    for group_hits in hits:
        for b in group_hits:
            if not 0 <= b < m.pool.config.num_blocks:
                raise UnknownBlock(f"hit block {b} is not a block of the pool")
    has_hits = any(hits)
    # Verify that hits come only with prefix caching
    if has_hits and not m.pool.config.enable_caching:
        raise CachingDisabled("cache hits passed to a manager without prefix caching")
    # Verify that only a request holding no blocks takes hits
    if has_hits and any(rid in m.tables[g].req_to_blocks for g in groups):
        raise HitOnRunningRequest(f"request {rid!r} already holds blocks")

    for g in groups:
        m, _ = single.remove_skipped_blocks(m, g, rid, request.num_computed_tokens)
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    num_slots = min(
        num_computed + num_new_tokens + num_lookahead_tokens, state.config.max_model_len
    )
    needed = sum(single.get_num_blocks_to_allocate(m, g, rid, num_slots, hits[g]) for g in groups)
    if needed > pool_ops.get_num_free_blocks(m.pool):
        return replace(state, managers=m), None

    if m.pool.config.enable_caching:
        pool = m.pool
        for group_hits in hits:
            pool, _ = pool_ops.touch(pool, group_hits)
        m = replace(m, pool=pool)
    new_blocks: list[tuple[int, ...]] = []
    for g in groups:
        m, _ = single.save_new_computed_blocks(m, g, rid, hits[g])
    for g in groups:
        m, new = single.allocate_new_blocks(m, g, rid, num_slots)
        new_blocks.append(new)
    if m.pool.config.enable_caching and not delay_cache_blocks:
        num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
        for g in groups:
            m, _ = single.cache_blocks(m, g, request, num_to_cache, state.config.use_eagle)
    return replace(state, managers=m), tuple(new_blocks)


def free(state: KVCacheManagerState, request_id: str) -> tuple[KVCacheManagerState, None]:
    """Release every block of the request in every group (each group's blocks last first).

    A request holding nothing is not an error (it was aborted before its
    first allocation).

    Complexity: O(blocks the request holds).

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> free(m, "nobody")[0] == m
    True
    """
    m = state.managers
    for g in range(len(m.specs)):
        m, _ = single.free(m, g, request_id)
    return replace(state, managers=m), None


def cache_blocks(
    state: KVCacheManagerState, request: Request, num_computed_tokens: int
) -> tuple[KVCacheManagerState, None]:
    """Cache the request's blocks that are full within ``num_computed_tokens``, if caching is on.

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8, enable_caching=False)
    >>> cache_blocks(m, new_request("r", [1, 2], 2), 2)[0] == m
    True
    """
    m = state.managers
    if not m.pool.config.enable_caching:
        return state, None
    for g in range(len(m.specs)):
        m, _ = single.cache_blocks(m, g, request, num_computed_tokens, state.config.use_eagle)
    return replace(state, managers=m), None


def evict_blocks(
    state: KVCacheManagerState, block_ids: Iterable[int]
) -> tuple[KVCacheManagerState, None]:
    """Remove the given blocks from the prefix cache (the pool's evict_blocks).

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> evict_blocks(m, {1})[0] == m
    True
    """
    pool, _ = pool_ops.evict_blocks(state.managers.pool, block_ids)
    return replace(state, managers=replace(state.managers, pool=pool)), None


def reset_prefix_cache(state: KVCacheManagerState) -> tuple[KVCacheManagerState, bool]:
    """Forget every cached hash if no request holds a block; report whether it happened.

    A successful reset is flagged in the stats, so the metrics restart.

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8, log_stats=True)
    >>> m, done = reset_prefix_cache(m)
    >>> done, m.stats.reset
    (True, True)
    """
    pool, done = pool_ops.reset_prefix_cache(state.managers.pool)
    state = replace(state, managers=replace(state.managers, pool=pool))
    if done and state.stats is not None:
        state = replace(state, stats=replace(state.stats, reset=True))
    return state, done


def make_prefix_cache_stats(
    state: KVCacheManagerState,
) -> tuple[KVCacheManagerState, PrefixCacheStats | None]:
    """Take the stats gathered so far (None unless log_stats) and start new ones.

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> make_prefix_cache_stats(m)[1] is None
    True
    """
    if state.stats is None:
        return state, None
    return replace(state, stats=PrefixCacheStats()), state.stats


def take_events(state: KVCacheManagerState) -> tuple[KVCacheManagerState, tuple[KVCacheEvent, ...]]:
    """Every pool event since the last call, oldest first.

    >>> from kvpool.model.single_type import full_attention
    >>> take_events(new_kv_cache_manager(4, [full_attention(2)], 8))[1]
    ()
    """
    pool, events = pool_ops.take_events(state.managers.pool)
    return replace(state, managers=replace(state.managers, pool=pool)), events


# --------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------


def get_num_common_prefix_blocks(state: KVCacheManagerState, request_id: str) -> tuple[int, ...]:
    """Per group, the leading blocks of the request shared by every request holding blocks.

    >>> from kvpool.model.single_type import full_attention
    >>> get_num_common_prefix_blocks(new_kv_cache_manager(4, [full_attention(2)], 8), "r")
    (0,)
    """
    m = state.managers
    return tuple(
        single.get_num_common_prefix_blocks(m, g, request_id, len(m.tables[g].req_to_blocks))
        for g in range(len(m.specs))
    )


def get_block_ids(state: KVCacheManagerState, request_id: str) -> Blocks:
    """The request's block table in each group (empty for a request holding nothing).

    >>> from kvpool.model.single_type import full_attention
    >>> get_block_ids(new_kv_cache_manager(4, [full_attention(2)], 8), "r")
    ((),)
    """
    return tuple(t.req_to_blocks.get(request_id, ()) for t in state.managers.tables)


def usage(state: KVCacheManagerState) -> float:
    """The fraction of usable blocks held (the pool's usage).

    >>> from kvpool.model.single_type import full_attention
    >>> usage(new_kv_cache_manager(4, [full_attention(2)], 8))
    0.0
    """
    return pool_ops.get_usage(state.managers.pool)


def num_free_blocks(state: KVCacheManagerState) -> int:
    """How many blocks the pool's free queue holds.

    >>> from kvpool.model.single_type import full_attention
    >>> num_free_blocks(new_kv_cache_manager(4, [full_attention(2)], 8))
    3
    """
    return pool_ops.get_num_free_blocks(state.managers.pool)


def running_request_ids(state: KVCacheManagerState) -> frozenset[str]:
    """The ids of the requests holding blocks in some group.

    >>> from kvpool.model.single_type import full_attention
    >>> running_request_ids(new_kv_cache_manager(4, [full_attention(2)], 8))
    frozenset()
    """
    return frozenset(r for t in state.managers.tables for r in t.req_to_blocks)
