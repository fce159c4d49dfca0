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

import kvpool.model.admission as admission
import kvpool.model.align_dcp as align_dcp
import kvpool.model.copy_on_write as cow
import kvpool.model.eagle as eagle_ops
import kvpool.model.external as external
import kvpool.model.geometry as geometry
import kvpool.model.hisparse_admission as hisparse_admission
import kvpool.model.hisparse_core as hisparse_core
import kvpool.model.mamba_align as mamba_align
import kvpool.model.mamba_align_eagle as align_eagle
import kvpool.model.mamba_fine as mamba_fine
import kvpool.model.mamba_fine_config as fine_config
import kvpool.model.mamba_reserve as reserve
import kvpool.model.pool as pool_ops
import kvpool.model.retention as retention
import kvpool.model.single_type as single
from kvpool.model.errors import (
    CachingDisabled,
    HitOnRunningRequest,
    InvalidArgument,
    InvalidHiSparseLayout,
    InvalidHit,
    InvalidManagerConfig,
    InvalidTokenCount,
    NoNewTokens,
    UnknownBlock,
)
from kvpool.model.events import MEDIUM_CPU, KVCacheEvent
from kvpool.model.hisparse_layout import (
    HiSparseConfig,
    HiSparseLayout,
    derive_layout,
    verify_features,
)
from kvpool.model.hisparse_state import HiSparseState
from kvpool.model.profiles import DEFAULT_PROFILE, Profile
from kvpool.model.request import Request, verify_hash_block_size
from kvpool.model.retention_config import verify_retention_interval
from kvpool.model.single_type import AttentionType, KVCacheSpec
from kvpool.model.state import NULL_BLOCK_ID, BlockHash, PoolState

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
    fine_grained_hits: bool = False
    """Hits may end inside a block (vLLM 0.33; ``kvpool.model.copy_on_write``)."""
    max_in_flight_tokens: int | None = None
    """Tokens scheduled and not yet processed, at most (vLLM 0.33); None: ``max_model_len``.
    It caps what a recycling group counts when a whole sequence must fit
    (``kvpool.model.admission``)."""
    num_prefill_lookahead: int = 0
    """Multi-module MTP's speculative tokens; the last ``num_prefill_lookahead - 1``
    computed tokens are not cached yet (``kvpool.model.eagle``)."""
    scheduler_block_size: int = 0
    """What hits of several groups are a multiple of (``kvpool.model.geometry``); 0 for
    a state built before kvpool modelled it, read as the first group's block size."""
    dcp_world_size: int = 1
    """Decode context parallelism: sharded groups' blocks hold this many times their tokens."""
    pcp_world_size: int = 1
    """Prefill context parallelism (checked at construction; blocks keep their size)."""
    retention_interval: int | None = None
    """vLLM 0.33's ``prefix_cache_retention_interval``: None caches densely; 0 or a
    multiple of the scheduler block size thins sliding-window groups
    (``kvpool.model.retention``)."""
    eagle_groups: tuple[int, ...] = ()
    """The groups flagged as EAGLE's (vLLM 0.33's ``is_eagle_group``); none: with
    ``use_eagle`` every group is (``kvpool.model.eagle.group_flags``)."""
    hisparse: HiSparseLayout | None = None
    """HiSparse's roles and numbers (``kvpool.model.hisparse_layout``); None without it."""


@dataclass(frozen=True)
class KVCacheManagerState:
    """A whole KV cache manager: its groups, the pool they share, and the hit stats."""

    config: ManagerConfig
    managers: single.ManagersState
    stats: PrefixCacheStats | None = None
    """None unless log_stats."""
    pending_copies: tuple[tuple[int, int], ...] = ()
    """Copy-on-write copies (source, destination) not yet taken by the scheduler, oldest first.
    Each end holds one extra reference until the scheduler frees it after the copy."""
    new_block_ids: tuple[tuple[int, int], ...] = ()
    """Blocks to zero before use, not yet taken (``take_new_block_ids``), as (group,
    block) in the order recorded: the copy destinations, and where the config needs
    zeroing (``records_new_block_ids``: beside a Mamba group) every new block of an
    attention group."""
    host_pool: PoolState | None = None
    """HiSparse's host pool (medium CPU), where the source group's blocks live; its events
    go to the end of the device pool's queue as they happen (``kvpool.model.hisparse_core``)."""
    hisparse: HiSparseState | None = None
    """HiSparse's coordinator books (``kvpool.model.hisparse_state``); None without it."""


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
    fine_grained_hits: bool = False,
    max_in_flight_tokens: int | None = None,
    num_prefill_lookahead: int = 0,
    scheduler_block_size: int | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    retention_interval: int | None = None,
    eagle_groups: Sequence[int] = (),
) -> KVCacheManagerState:
    """A manager over a fresh pool of ``num_blocks``, one group per spec.

    (A manager with HiSparse groups: ``new_hisparse_manager``.)

    Groups may have different block sizes (``kvpool.model.geometry``): each a
    multiple of ``hash_block_size`` (by default their greatest common divisor),
    all dividing ``scheduler_block_size`` (by default their least common
    multiple), which hits of several groups are a multiple of. With
    ``dcp_world_size`` > 1 a sharded group's blocks hold that many times its
    ``block_size`` tokens; the state keeps those effective sizes. A Mamba
    group's block must hold a whole request (``block_size >= max_model_len``)
    unless it is in "align" mode, which needs its block to be one hash block and
    either every group's block and the scheduler block of that size too, or no
    decode context parallelism (``verify_align_geometry``); with caching on, a block of
    several hash blocks beside full attention only, hits then ending inside it
    (``kvpool.model.mamba_fine_config``), or, under decode context parallelism, blocks of
    one hash block beside full attention, hits then ending on hash blocks
    (``kvpool.model.align_dcp``). EAGLE and multi-module MTP's
    ``num_prefill_lookahead`` as ``kvpool.model.eagle.verify_eagle_config``
    allows; ``eagle_groups`` flags the groups EAGLE runs on (none: every group;
    ``kvpool.model.eagle.group_flags``). ``fine_grained_hits`` asks for hits
    ending inside a block; it takes
    effect only where ``copy_on_write.fine_grained_hits_enabled`` allows it
    (vllm#51843) and the groups share one block size. ``retention_interval`` is vLLM
    0.33's ``prefix_cache_retention_interval`` (``kvpool.model.retention``), checked by
    ``retention_config.verify_retention_interval``.

    Complexity: O(num_blocks + len(specs)).

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(8, [full_attention(4)], max_model_len=32)
    >>> usage(m)
    0.0
    """
    return _new_manager(
        num_blocks,
        specs,
        max_model_len,
        hash_block_size,
        enable_caching,
        use_eagle,
        log_stats,
        enable_events,
        profile,
        fine_grained_hits,
        max_in_flight_tokens,
        num_prefill_lookahead,
        scheduler_block_size,
        dcp_world_size,
        pcp_world_size,
        retention_interval,
        eagle_groups,
        None,
    )


def new_hisparse_manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec],
    max_model_len: int,
    hisparse: HiSparseConfig,
    hash_block_size: int | None = None,
    enable_caching: bool = True,
    use_eagle: bool = False,
    log_stats: bool = False,
    enable_events: bool = False,
    profile: Profile = DEFAULT_PROFILE,
    fine_grained_hits: bool = False,
    max_in_flight_tokens: int | None = None,
    num_prefill_lookahead: int = 0,
    scheduler_block_size: int | None = None,
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
    retention_interval: int | None = None,
    eagle_groups: Sequence[int] = (),
) -> KVCacheManagerState:
    """``new_kv_cache_manager`` for a manager whose groups play HiSparse's roles.

    ``hisparse`` names the roles beside the specs (``kvpool.model.hisparse_layout``,
    which checks them as vLLM 0.33.0's ``HiSparseCoordinator.__init__`` does and refuses
    by name what no slice models beside HiSparse); the source group's blocks come from a
    host pool of ``host_num_blocks`` (docs/hisparse.md). A constructor of its own, not a
    keyword of ``new_kv_cache_manager``, whose callers spread ``dict[str, int]`` keywords.

    >>> from kvpool.model.hisparse_layout import HiSparseConfig
    >>> from kvpool.model.single_type import full_attention
    >>> roles = HiSparseConfig((0,), 16, (1,), (2,), ((3, 2),))
    >>> m = new_hisparse_manager(32, [full_attention(16)] * 4, 128, roles, hash_block_size=16)
    >>> m.host_pool.config.medium, num_free_blocks(m)
    ('CPU', 31)
    """
    return _new_manager(
        num_blocks,
        specs,
        max_model_len,
        hash_block_size,
        enable_caching,
        use_eagle,
        log_stats,
        enable_events,
        profile,
        fine_grained_hits,
        max_in_flight_tokens,
        num_prefill_lookahead,
        scheduler_block_size,
        dcp_world_size,
        pcp_world_size,
        retention_interval,
        eagle_groups,
        hisparse,
    )


def _new_manager(
    num_blocks: int,
    specs: Sequence[KVCacheSpec],
    max_model_len: int,
    hash_block_size: int | None,
    enable_caching: bool,
    use_eagle: bool,
    log_stats: bool,
    enable_events: bool,
    profile: Profile,
    fine_grained_hits: bool,
    max_in_flight_tokens: int | None,
    num_prefill_lookahead: int,
    scheduler_block_size: int | None,
    dcp_world_size: int,
    pcp_world_size: int,
    retention_interval: int | None,
    eagle_groups: Sequence[int],
    hisparse: HiSparseConfig | None,
) -> KVCacheManagerState:
    """``new_kv_cache_manager``'s work, with HiSparse roles or without (None)."""
    # Verify that requests can hold at least one token
    if max_model_len < 1:
        raise InvalidManagerConfig(f"max_model_len={max_model_len} must be positive")
    # Verify that at least one token may be in flight
    if max_in_flight_tokens is not None and max_in_flight_tokens < 1:
        raise InvalidManagerConfig(f"max_in_flight_tokens={max_in_flight_tokens} must be positive")
    # Verify that there is at least one group
    if not specs:
        raise InvalidManagerConfig("a KV cache manager needs at least one group")
    # Verify that context parallelism runs only on the groups vLLM runs it on
    geometry.verify_context_parallel(specs, dcp_world_size, pcp_world_size)
    specs = geometry.effective_specs(specs, dcp_world_size)
    hbs = geometry.default_hash_block_size(specs) if hash_block_size is None else hash_block_size
    layout: HiSparseLayout | None = None
    if hisparse is not None:
        # Verify that HiSparse comes without the features no slice models beside it
        verify_features(
            use_eagle,
            eagle_groups,
            retention_interval,
            dcp_world_size,
            pcp_world_size,
            fine_grained_hits,
        )
        # Verify the HiSparse layout as vLLM's coordinator does
        layout = derive_layout(
            hisparse,
            specs,
            num_blocks,
            max_model_len,
            max_in_flight_tokens,
            eagle_ops.num_reprefillable_tokens(num_prefill_lookahead),
        )
    # Verify that a Mamba block holds a whole request, or the group is in "align" mode
    for spec in specs:
        if (
            spec.attention is AttentionType.MAMBA
            and spec.block_size < max_model_len
            and not spec.mamba_align
        ):
            raise InvalidManagerConfig(
                f"a Mamba block of {spec.block_size} tokens cannot hold {max_model_len} tokens"
            )
    # Verify that EAGLE runs beside Mamba "align" groups only as modelled (no checkpoint blocks)
    align_eagle.verify(specs, use_eagle)
    # Verify that hits inside a Mamba "align" block come in a configuration kvpool models
    fine_mamba = fine_config.enabled(specs, hbs, enable_caching)
    if fine_mamba:
        fine_config.verify(specs, hbs, use_eagle, retention_interval, dcp_world_size)
    # Verify that "align" under decode context parallelism (hits on hash blocks) is modelled
    elif align_dcp.enabled(specs, hbs, enable_caching, dcp_world_size):
        align_dcp.verify(specs, hbs, use_eagle, retention_interval)
        fine_mamba = True
    try:
        pool = pool_ops.new_pool(num_blocks, enable_caching, hbs, enable_events, profile)
    except ValueError as error:
        raise InvalidManagerConfig(str(error)) from error
    managers = single.new_managers(pool, specs)
    scheduler = (
        geometry.default_scheduler_block_size(specs)
        if scheduler_block_size is None
        else scheduler_block_size
    )
    # Verify that the scheduler block size is a multiple of every block size
    geometry.verify_scheduler_block_size(specs, hbs, scheduler)
    # Verify that a Mamba "align" group's block is every group's and the scheduler's, or one
    # hash block beside larger blocks (not modelled otherwise: hits inside a Mamba block)
    if not fine_mamba:
        verify_align_geometry(specs, scheduler, hbs, dcp_world_size)
    # Verify that the retention interval is one vLLM 0.33 takes for these groups
    verify_retention_interval(retention_interval, specs, scheduler)
    # Verify that the groups flagged as EAGLE's exist
    eagle_ops.verify_eagle_groups(specs, eagle_groups)
    # Verify that reserved blocks sit where kvpool models them: hash block = block = scheduler,
    # or checkpoints where hits may end inside a Mamba block (kvpool.model.mamba_fine_config)
    if not fine_mamba:
        reserve.verify_reserving_geometry(specs, hbs if enable_caching else 0, scheduler)
    # Verify that EAGLE and the look-ahead are settings vLLM 0.33 runs
    eagle_ops.verify_eagle_config(
        specs, enable_caching, use_eagle, num_prefill_lookahead, scheduler, eagle_groups
    )
    fine = fine_mamba or (
        cow.fine_grained_hits_enabled(specs, hbs, fine_grained_hits, use_eagle)
        and len({s.block_size for s in specs}) == 1
    )
    config = ManagerConfig(
        max_model_len,
        use_eagle,
        log_stats,
        fine,
        max_in_flight_tokens,
        num_prefill_lookahead,
        scheduler,
        dcp_world_size,
        pcp_world_size,
        retention_interval,
        tuple(eagle_groups),
        layout,
    )
    host_pool = None
    if layout is not None:
        host_pool = pool_ops.new_pool(
            layout.host_num_blocks, enable_caching, hbs, enable_events, profile, MEDIUM_CPU
        )
    return KVCacheManagerState(
        config=config,
        managers=managers,
        stats=PrefixCacheStats() if log_stats else None,
        host_pool=host_pool,
        hisparse=HiSparseState() if layout is not None else None,
    )


def tiers(state: KVCacheManagerState) -> hisparse_core.Tiers:
    """A HiSparse manager's parts (``kvpool.model.hisparse_core``)."""
    layout = state.config.hisparse
    # Verify that the manager has HiSparse groups (vLLM: get_hisparse_coordinator)
    if layout is None or state.host_pool is None or state.hisparse is None:
        raise InvalidHiSparseLayout("No HiSparse cache group is configured")
    return hisparse_core.Tiers(state.managers, state.host_pool, state.hisparse, layout)


def with_tiers(state: KVCacheManagerState, t: hisparse_core.Tiers) -> KVCacheManagerState:
    """The manager with its HiSparse parts replaced."""
    return replace(state, managers=t.managers, host_pool=t.host, hisparse=t.hs)


def verify_align_geometry(
    specs: Sequence[KVCacheSpec],
    scheduler_block_size: int,
    hash_block_size: int | None = None,
    dcp_world_size: int = 1,
) -> None:
    """Raise InvalidManagerConfig where a Mamba "align" group meets a block geometry kvpool
    does not model.

    Modelled: every group's (effective) block and the scheduler block of one size; or,
    without decode context parallelism, every "align" group's block one hash block long
    beside groups of larger blocks and a scheduler block that is a multiple of them all.
    There vLLM 0.33.0 keeps fine-grained hits off (``partial_hash_hits_enabled`` in
    ``vllm/v1/core/kv_cache_utils.py`` wants a Mamba block longer than a hash block, or
    ``dcp_world_size > 1``), so hits end on multiples of the scheduler block
    (``HybridKVCacheCoordinator._cache_hit_alignment_tokens``) and a Mamba block never
    holds a hit's end inside it: ``kvpool.model.mamba_align`` with ``find_hit``'s
    ``alignment`` is the whole of it. Refused: Mamba blocks of several hash blocks beside
    other sizes with caching off (with caching on ``kvpool.model.mamba_fine_config``
    decides instead, and this is not called), and any size mix under decode context
    parallelism with caching off (with caching on and "align" blocks of one hash block
    ``kvpool.model.align_dcp`` models it, and this is not called). docs/limits.md.

    >>> from kvpool.model.single_type import full_attention, mamba_align
    >>> verify_align_geometry([full_attention(4), mamba_align(4)], 4)
    >>> verify_align_geometry([full_attention(8), mamba_align(4)], 8, 4)
    >>> verify_align_geometry([full_attention(4), mamba_align(8)], 8, 4)
    Traceback (most recent call last):
    ...
    kvpool.model.errors.InvalidManagerConfig: Mamba "align" beside blocks of sizes [4, 8] ...
    """
    if not any(s.mamba_align for s in specs):
        return
    sizes = [s.block_size for s in specs]
    if len(set(sizes)) == 1 and scheduler_block_size == sizes[0]:
        return
    # Verify that every "align" block is one hash block, without decode context parallelism
    if dcp_world_size != 1 or any(s.mamba_align and s.block_size != hash_block_size for s in specs):
        raise InvalidManagerConfig(
            f'Mamba "align" beside blocks of sizes {sizes} with '
            f"scheduler_block_size={scheduler_block_size} is not modelled unless every "
            f"align block is one hash block ({hash_block_size} tokens) and "
            f"dcp_world_size=1 (got {dcp_world_size})"
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
    type shortens it (one round for full attention and one other type), then
    trim full-attention hits to that length. With EAGLE each type's search
    peeks one block past the candidate and drops its last block, once per
    candidate length (``kvpool.model.eagle``). With several groups every
    search's hit is a multiple of the scheduler block size, and each group's
    blocks are trimmed with its own block size (``kvpool.model.geometry``).
    With fine-grained hits a
    full-attention search may end inside a block
    (``copy_on_write.extend_into_partial_block``).

    Complexity: O(groups * max_length / block_size) lookups per round.

    >>> from kvpool.model.single_type import full_attention
    >>> find_hit(new_kv_cache_manager(4, [full_attention(2)], 8), [b"x"], 3)
    (((),), 0)
    """
    blocks, length, _ = find_hit_with_boundary(state, block_hashes, max_length)
    return blocks, length


def find_hit_with_boundary(
    state: KVCacheManagerState, block_hashes: Sequence[BlockHash], max_length: int
) -> tuple[Blocks, int, int]:
    """``find_hit``, and how many tokens past the hit some group's own search reached.

    The third value is vLLM 0.33's ``num_uncached_common_prefix_tokens``: the
    longest length any search returned minus the reconciled hit (0 with one
    group).

    >>> from kvpool.model.single_type import full_attention
    >>> find_hit_with_boundary(new_kv_cache_manager(4, [full_attention(2)], 8), [b"x"], 3)
    (((),), 0, 0)
    """
    m = state.managers
    specs = m.specs
    flags = _eagle_flags(state)
    fine = state.config.fine_grained_hits
    if len(specs) == 1:
        (hit,), length = _search(m.pool, specs[0], block_hashes, max_length, [0], flags[0], fine)
        return (hit,), length, 0
    # hits of several groups end where every group can resume (kvpool.model.geometry)
    alignment = 0 if fine else _scheduler_block_size(state)

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
    lengths: dict[int, int] = {}
    length = max_length
    longest = 0
    # Two kinds, full attention first: the second cannot shorten what the first allows
    # twice, so one round suffices (vLLM stops there even with EAGLE's peeks).
    simple = len(kinds) == 2 and kinds[0][0].attention is AttentionType.FULL
    num_hashed = len(block_hashes) * m.pool.config.hash_block_size
    verified: set[int] = set()
    """Kinds whose EAGLE drop was applied at the current candidate length."""
    while True:
        candidate = length
        for k, (spec, ids) in enumerate(kinds):
            if spec.attention is AttentionType.FULL and ids[0] in hits:
                candidate = min(candidate, lengths[ids[0]])
                continue
            drop = any(flags[g] for g in ids) and k not in verified
            reach = eagle_ops.peek(spec, candidate, num_hashed) if drop else candidate
            found, found_length = _search(
                m.pool, spec, block_hashes, reach, ids, drop, fine, alignment
            )
            if drop:
                verified.add(k)
            elif found_length < candidate:
                verified.clear()  # a shorter candidate: every EAGLE kind drops again
            candidate = found_length
            for g, blocks in zip(ids, found, strict=True):
                hits[g] = blocks
                lengths[g] = candidate
            longest = max(longest, candidate)
        if candidate >= length:
            break
        length = candidate
        if simple:
            break
    # every group's hit cut back to the reconciled length, in its own blocks
    trimmed = tuple(hits[g][: -(-length // specs[g].block_size)] for g in range(len(specs)))
    return trimmed, length, longest - length


def _eagle_flags(state: KVCacheManagerState) -> tuple[bool, ...]:
    """Per group, whether it drops EAGLE's block (``kvpool.model.eagle.group_flags``)."""
    config = state.config
    return eagle_ops.group_flags(state.managers.specs, config.use_eagle, config.eagle_groups)


def _scheduler_block_size(state: KVCacheManagerState) -> int:
    return state.config.scheduler_block_size or state.managers.specs[0].block_size


def _search(
    pool: PoolState,
    spec: KVCacheSpec,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    ids: Sequence[int],
    eagle: bool,
    fine: bool,
    alignment: int = 0,
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """One attention type's hit for groups ``ids`` and its length in tokens, a multiple of
    ``alignment`` when one is given."""
    if fine and spec.mamba_align:
        return mamba_fine.find_hit(pool, spec.block_size, block_hashes, max_length, ids)
    found = single.find_longest_cache_hit(
        pool, spec, block_hashes, max_length, ids, eagle, alignment
    )
    if fine and spec.attention is AttentionType.FULL:
        return cow.extend_into_partial_block(pool, spec, block_hashes, max_length, ids, found)
    return found, len(found[0]) * spec.block_size


def get_computed_blocks(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int]]:
    """The cached blocks the request may reuse and how many tokens they cover.

    At most ``num_tokens - 1`` tokens hit: the last token is always
    computed, for its logits. Nothing hits when caching is off or the
    request skips reading the cache; only real lookups are counted in the
    stats. (vLLM 0.33 answers a third value too: see
    ``get_computed_blocks_with_boundary``.)

    Complexity: that of ``find_hit``.

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> get_computed_blocks(m, new_request("r", [1, 2, 3], 2))[1]
    (((),), 0)
    """
    state, (blocks, num_tokens, _) = get_computed_blocks_with_boundary(state, request)
    return state, (blocks, num_tokens)


def get_computed_blocks_with_boundary(
    state: KVCacheManagerState, request: Request
) -> tuple[KVCacheManagerState, tuple[Blocks, int, int]]:
    """vLLM 0.33's ``get_computed_blocks``: the hit, its tokens, and the shared-prefix boundary.

    The boundary is the hit plus the tokens some group's own search reached
    beyond it, or 0 when no group reached further (always 0 with one group).

    Complexity: that of ``find_hit``.

    >>> from kvpool.model.single_type import full_attention
    >>> from kvpool.model.request import new_request
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> get_computed_blocks_with_boundary(m, new_request("r", [1, 2, 3], 2))[1]
    (((),), 0, 0)
    """
    # Verify that the request is hashed in the pool's hash blocks
    verify_hash_block_size(request, state.managers.pool.config.hash_block_size)
    empty: Blocks = tuple(() for _ in state.managers.specs)
    if not state.managers.pool.config.enable_caching or request.skip_reading_prefix_cache:
        return state, (empty, 0, 0)
    if state.config.hisparse is not None:
        blocks, num_tokens, uncached = hisparse_admission.find_hit(
            tiers(state), request.block_hashes, request.num_tokens - 1
        )
    else:
        blocks, num_tokens, uncached = find_hit_with_boundary(
            state, request.block_hashes, request.num_tokens - 1
        )
    if state.stats is not None:
        stats = record(state.stats, request.num_tokens, num_tokens, request.num_preemptions > 0)
        state = replace(state, stats=stats)
    return state, (blocks, num_tokens, num_tokens + uncached if uncached else 0)


def allocate_slots(
    state: KVCacheManagerState,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Blocks | None = None,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
    full_sequence_must_fit: bool = False,
    *,
    num_external_computed_tokens: int = 0,
    reserved_blocks: int = 0,
    skip_zeroing_group_ids: Sequence[int] = (),
) -> tuple[KVCacheManagerState, Blocks | None]:
    """Give the request slots for ``num_new_tokens`` more tokens (and look-ahead), or refuse.

    In this order: with ``full_sequence_must_fit``, refuse with None, changing
    nothing, unless the request's whole sequence fits (``kvpool.model.admission``);
    free the blocks that left every group's attention window
    (even if the call is then refused); count the blocks needed, cache hits
    that are free now included; refuse with None if the pool has fewer
    free blocks, changing nothing else; take the hits (touch), record them,
    append new blocks; then cache every block that is full within the
    computed, hit and new tokens, never past the request's own tokens
    (draft tokens are not final). Returns the new blocks per group.

    A KV connector's loads (``kvpool.model.external``): a request holding
    nothing may come with ``num_external_computed_tokens`` past its hit (then
    ``num_new_tokens`` may be 0: the load runs first), which get blocks of their
    own after every group's hit is taken (recorded for zeroing unless the group
    is in ``skip_zeroing_group_ids``) and count as computed; the step is refused
    unless ``reserved_blocks`` free blocks remain after it.

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
    # Verify that sparse retention can read the request's shared-prefix boundary
    _verify_shared_prefix_boundary(state, request)
    ext = num_external_computed_tokens
    # Verify that at least one new token is asked for (none while external tokens load)
    if num_new_tokens < 0 or (num_new_tokens == 0 and ext <= 0):
        raise NoNewTokens(f"num_new_tokens must be positive, got {num_new_tokens}")
    # Verify that the other counts are not negative
    if num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
        raise InvalidTokenCount("num_new_computed_tokens and num_lookahead_tokens must be >= 0")
    # Verify that the KV connector's arguments are valid (kvpool.model.external)
    external.verify_connector_arguments(
        m, request, num_new_computed_tokens, ext, reserved_blocks, skip_zeroing_group_ids
    )
    # Verify that the hits have one entry per group, of known blocks (of its own pool)
    if len(hits) != len(m.specs):
        raise InvalidHit(f"{len(hits)} hit lists for {len(m.specs)} groups")
    layout = state.config.hisparse
    for g, group_hits in enumerate(hits):
        size = m.pool.config.num_blocks
        if layout is not None and g == layout.source and state.host_pool is not None:
            size = state.host_pool.config.num_blocks
        for b in group_hits:
            if not 0 <= b < size:
                raise UnknownBlock(f"hit block {b} is not a block of the pool")
    if layout is not None:
        t, result = hisparse_admission.allocate(
            tiers(state),
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            ext,
            reserved_blocks,
            state.config.max_model_len,
            _scheduler_block_size(state),
        )
        return with_tiers(state, t), result
    has_hits = any(hits)
    # Verify that hits come only with prefix caching
    if has_hits and not m.pool.config.enable_caching:
        raise CachingDisabled("cache hits passed to a manager without prefix caching")
    # Verify that only a request holding no blocks takes hits
    if has_hits and any(rid in m.tables[g].req_to_blocks for g in groups):
        raise HitOnRunningRequest(f"request {rid!r} already holds blocks")
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    # A hit ending inside a block is copied to a private block (copy-on-write)
    partial = [bool(hits[g]) and num_computed % m.specs[g].block_size != 0 for g in groups]
    # Verify that external tokens do not follow a hit ending inside a block (not modelled)
    if ext > 0 and any(partial):
        raise InvalidArgument("external tokens after a hit ending inside a block: not modelled")
    # the local hit and the external tokens (kvpool.model.external)
    num_total = min(num_computed + ext, state.config.max_model_len)
    # Verify that a hit ending inside a block ends in its last block
    for g in groups:
        if partial[g] and num_computed // m.specs[g].block_size != len(hits[g]) - 1:
            raise InvalidHit(
                f"a hit of {num_computed} tokens ends in block "
                f"{num_computed // m.specs[g].block_size}, not in the last of the "
                f"{len(hits[g])} hit blocks of group {g}"
            )

    if full_sequence_must_fit:
        config = state.config
        in_flight = config.max_in_flight_tokens or config.max_model_len
        full = min(request.num_tokens, config.max_model_len)
        if ext > 0:
            fits = external.full_sequence_fits(
                m, full, hits, num_computed + ext, in_flight, config.max_model_len
            )
        else:
            fits = admission.full_sequence_fits(
                m,
                rid,
                full,
                hits,
                partial,
                in_flight,
                config.max_model_len,
                min(num_computed, config.max_model_len),
                _scheduler_block_size(state),
            )
        if not fits:
            return state, None
    for g in groups:
        m, _ = single.remove_skipped_blocks(m, g, rid, request.num_computed_tokens)
    num_slots = min(num_total + num_new_tokens + num_lookahead_tokens, state.config.max_model_len)
    # A Mamba "align" group sizes its table by the main model's tokens, not the look-ahead
    slots = [num_computed + num_new_tokens if s.mamba_align else num_slots for s in m.specs]
    if ext > 0:
        needed = sum(
            external.num_blocks_to_allocate(
                m.pool, m.specs[g], slots[g], hits[g], num_computed + ext
            )
            for g in groups
        )
    else:
        # a Mamba "align" group with checkpoint blocks records its checkpoint as it counts
        for g in groups:
            m, _ = single.plan_checkpoint(
                m, g, rid, num_computed, slots[g], _scheduler_block_size(state)
            )
        needed = sum(
            single.get_num_blocks_to_allocate(m, g, rid, slots[g], hits[g]) for g in groups
        )
    needed += sum(partial)
    if needed > pool_ops.get_num_free_blocks(m.pool) - reserved_blocks:
        return replace(state, managers=m), None
    if ext > 0:
        state = replace(state, managers=m)
        return _allocate_with_external(
            state,
            request,
            num_computed,
            ext,
            num_new_tokens,
            slots,
            hits,
            delay_cache_blocks,
            skip_zeroing_group_ids,
        )

    if m.pool.config.enable_caching:
        pool = m.pool
        for group_hits in hits:
            pool, _ = pool_ops.touch(pool, group_hits)
        m = replace(m, pool=pool)
    new_blocks: list[tuple[int, ...]] = []
    for g in groups:
        m, _ = single.save_new_computed_blocks(m, g, rid, hits[g])
        if partial[g]:
            # only the whole blocks count as cached: the copy is cached once full
            m = _with_num_cached(m, g, rid, num_computed // m.specs[g].block_size)
    copies = state.pending_copies
    zero = state.new_block_ids
    for g in groups:
        copied: tuple[int, ...] = ()
        if state.config.fine_grained_hits and m.specs[g].mamba_align:
            # a Mamba state a hit ends inside, or one the request keyed inside a block, is
            # copied by the group itself (kvpool.model.mamba_fine.allocate)
            index = num_computed // m.specs[g].block_size
            hit = (index, hits[g][-1]) if partial[g] else None
            m, new, copy = single.allocate_mamba_copy(m, g, rid, slots[g], hit)
            if copy is not None:
                copies = (*copies, copy)
            new_blocks.append(new)
            continue
        if partial[g]:
            m, destination = _copy_on_write(m, g, rid, num_computed // m.specs[g].block_size)
            copies = (*copies, (hits[g][-1], destination))
            zero = (*zero, (g, destination))
            copied = (destination,)
        m, new = single.allocate_new_blocks(m, g, rid, slots[g])
        if records_new_block_ids(m.specs, g):
            zero = (*zero, *((g, b) for b in new))
        new_blocks.append(copied + new)
    state = replace(state, pending_copies=copies, new_block_ids=zero)
    if m.pool.config.enable_caching and not delay_cache_blocks:
        num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
        m = _cache(state, m, request, num_to_cache)
    return replace(state, managers=m), tuple(new_blocks)


def _allocate_with_external(
    state: KVCacheManagerState,
    request: Request,
    num_local: int,
    num_external: int,
    num_new_tokens: int,
    slots: Sequence[int],
    hits: Blocks,
    delay_cache_blocks: bool,
    skip_zeroing_group_ids: Sequence[int],
) -> tuple[KVCacheManagerState, Blocks]:
    """``allocate_slots``' taking and allocating for a request holding nothing that comes
    with external tokens (checked, counted and known to fit; ``kvpool.model.external``).

    Every group takes its hit past its skipped blocks first (nulls before them),
    then every group gives the external tokens their blocks, then the step's.
    """
    m = state.managers
    groups = range(len(m.specs))
    rid = request.request_id
    total = num_local + num_external
    taken = [external.taken_hits(m.specs[g], hits[g], total) for g in groups]
    if m.pool.config.enable_caching:
        pool = m.pool
        for _, kept in taken:
            pool, _ = pool_ops.touch(pool, kept)
        m = replace(m, pool=pool)
    for g, (skipped, kept) in enumerate(taken):
        m, _ = single.save_new_computed_blocks(m, g, rid, (NULL_BLOCK_ID,) * skipped + kept)
    zero = state.new_block_ids
    for g in groups:
        held = len(m.tables[g].req_to_blocks[rid])
        count = external.num_external_blocks(m.specs[g], held, num_local, num_external)
        m, loaded = single.allocate_new_blocks(m, g, rid, (held + count) * m.specs[g].block_size)
        if records_new_block_ids(m.specs, g) and g not in skip_zeroing_group_ids:
            zero = (*zero, *((g, b) for b in loaded))
    new_blocks: list[tuple[int, ...]] = []
    for g in groups:
        m, new = single.allocate_new_blocks(m, g, rid, slots[g])
        if records_new_block_ids(m.specs, g):
            zero = (*zero, *((g, b) for b in new))
        new_blocks.append(new)
    state = replace(state, new_block_ids=zero)
    if m.pool.config.enable_caching and not delay_cache_blocks:
        num_computed = min(total, state.config.max_model_len)
        m = _cache(state, m, request, min(num_computed + num_new_tokens, request.num_tokens))
    return replace(state, managers=m), tuple(new_blocks)


def _with_num_cached(
    m: single.ManagersState, group: int, request_id: str, count: int
) -> single.ManagersState:
    table = m.tables[group]
    table = replace(table, num_cached_block={**table.num_cached_block, request_id: count})
    return replace(m, tables=(*m.tables[:group], table, *m.tables[group + 1 :]))


def _copy_on_write(
    m: single.ManagersState, group: int, request_id: str, index: int
) -> tuple[single.ManagersState, int]:
    """Put a fresh block in place of the request's shared block ``index``; return it.

    The fresh block takes a second reference (the pending copy's); the
    source keeps the request's reference until the scheduler frees it after
    the copy.
    """
    pool, (destination,) = pool_ops.get_new_blocks(m.pool, 1)
    pool, _ = pool_ops.touch(pool, [destination])
    table = m.tables[group]
    blocks = table.req_to_blocks[request_id]
    blocks = (*blocks[:index], destination, *blocks[index + 1 :])
    table = replace(table, req_to_blocks={**table.req_to_blocks, request_id: blocks})
    return replace(m, pool=pool, tables=(*m.tables[:group], table, *m.tables[group + 1 :])), (
        destination
    )


def _cache(
    state: KVCacheManagerState, m: single.ManagersState, request: Request, num_tokens: int
) -> single.ManagersState:
    """Cache every group's full blocks, and the prompt's tail where blocks hold several hash blocks.

    Each group caches what ``eagle.cacheable_tokens`` allows of ``num_tokens``
    (with several groups rounded to the scheduler block size, where every group
    can resume, and an EAGLE group one of its blocks further; without the
    tokens multi-module MTP may prefill again), a sliding-window group only the
    blocks a hit at those boundaries can use (under sparse retention only those a
    replay of the prompt can use, and the retention segments' tails:
    ``kvpool.model.retention``). With fine-grained hits the tail is cached without
    rounding the cacheable tokens down (``single.cache_blocks``).
    """
    config = state.config
    reprefillable = eagle_ops.num_reprefillable_tokens(config.num_prefill_lookahead)
    scheduler = _scheduler_block_size(state)
    # sparse retention keeps the windows a replay of the prompt can resume from
    boundaries = (
        retention.replay_boundaries(request.num_prompt_tokens, scheduler, config.use_eagle)
        if config.retention_interval is not None
        else ()
    )
    flags = _eagle_flags(state)
    for g, spec in enumerate(m.specs):
        cacheable = eagle_ops.cacheable_tokens(
            len(m.specs),
            spec.block_size,
            scheduler,
            flags[g],
            config.fine_grained_hits,
            reprefillable,
            num_tokens,
        )
        m, _ = single.cache_blocks(
            m,
            g,
            request,
            cacheable,
            flags[g],
            config.fine_grained_hits,
            scheduler,
            config.retention_interval,
            boundaries,
            # vLLM 0.33 moves every Mamba group's prompt boundary under EAGLE, flagged or not
            config.use_eagle,
        )
    return m


def free(
    state: KVCacheManagerState, request_id: str, *, finished: bool = False
) -> tuple[KVCacheManagerState, None]:
    """Release every block of the request in every group (each group's blocks last first).

    A request holding nothing is not an error (it was aborted before its
    first allocation). ``finished`` is what vLLM reads from the request's status
    (``Request.is_finished``): with HiSparse, a finished request's pending publication
    waits for its spills, anyone else's is dropped (``kvpool.model.hisparse_core.free``).

    Complexity: O(blocks the request holds).

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> free(m, "nobody")[0] == m
    True
    """
    if state.config.hisparse is not None:
        return with_tiers(state, hisparse_core.free(tiers(state), request_id, finished)), None
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
    # Verify that sparse retention can read the request's shared-prefix boundary
    _verify_shared_prefix_boundary(state, request)
    if not m.pool.config.enable_caching:
        return state, None
    if state.config.hisparse is not None:
        return with_tiers(state, _cache_hisparse(state, request, num_computed_tokens)), None
    return replace(state, managers=_cache(state, m, request, num_computed_tokens)), None


def _cache_hisparse(
    state: KVCacheManagerState, request: Request, num_computed_tokens: int
) -> hisparse_core.Tiers:
    """The indexers cache; the source records its publication (``hisparse_core``)."""
    t = tiers(state)
    cacheable = eagle_ops.cacheable_tokens(
        len(t.managers.specs),
        t.layout.block_size,
        _scheduler_block_size(state),
        False,
        False,
        t.layout.num_reprefillable_tokens,
        num_computed_tokens,
    )
    for g in range(len(t.managers.specs)):
        if g == t.layout.source:
            t = hisparse_core.publish_when_ready(t, request, cacheable)
        elif g in t.layout.indexers:
            managers, _ = single.cache_blocks(t.managers, g, request, cacheable)
            t = replace(t, managers=managers)
    return t


def _verify_shared_prefix_boundary(state: KVCacheManagerState, request: Request) -> None:
    """InvalidTokenCount if the manager retains sparsely and the request's
    ``shared_prefix_boundary`` (``kvpool.model.retention``) is negative."""
    if state.config.retention_interval is not None and request.shared_prefix_boundary < 0:
        raise InvalidTokenCount(
            f"shared_prefix_boundary={request.shared_prefix_boundary} is negative"
        )


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
    if state.config.hisparse is not None:
        # Both pools reset, the host's first, or neither: a refused reset changes nothing.
        # vLLM 0.33.0 resets an idle pool even when the other refuses
        # (KVCacheCoordinator.reset_prefix_cache): a recorded finding (docs/hisparse.md)
        t, done = hisparse_core.host_pool(tiers(state), pool_ops.reset_prefix_cache)
        if not done:
            return state, False
        t, done = hisparse_core.device_pool(t, pool_ops.reset_prefix_cache)
        if not done:
            return state, False
        state = with_tiers(state, t)
    else:
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
# vLLM 0.33's further scheduler calls
# --------------------------------------------------------------------------


def take_kv_cache_block_copies(
    state: KVCacheManagerState,
) -> tuple[KVCacheManagerState, tuple[tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """The pending copies (source, destination), oldest first, and the blocks they retain.

    The retained blocks are each copy's source then destination; each holds
    one reference for the copy, which the scheduler releases with
    ``free_blocks`` once the copy has run.

    >>> from kvpool.model.single_type import full_attention
    >>> take_kv_cache_block_copies(new_kv_cache_manager(4, [full_attention(2)], 8))[1]
    ((), ())
    """
    copies = state.pending_copies
    retained = tuple(b for pair in copies for b in pair)
    return replace(state, pending_copies=()), (copies, retained)


def free_blocks(
    state: KVCacheManagerState, block_ids: Sequence[int]
) -> tuple[KVCacheManagerState, None]:
    """Drop one reference per listed block (the pool's free_blocks), as the scheduler
    does with the blocks a copy retained.

    >>> from kvpool.model.single_type import full_attention
    >>> free_blocks(new_kv_cache_manager(4, [full_attention(2)], 8), [])[1] is None
    True
    """
    pool, _ = pool_ops.free_blocks(state.managers.pool, block_ids)
    return replace(state, managers=replace(state.managers, pool=pool)), None


def truncate_computed_blocks(
    state: KVCacheManagerState, blocks: Blocks, num_computed_tokens: int
) -> Blocks:
    """A hit cut back to ``num_computed_tokens``, a whole number of every group's blocks.

    Pure: nothing is touched. A Mamba group keeps what it has if shorter.

    >>> from kvpool.model.single_type import full_attention
    >>> truncate_computed_blocks(new_kv_cache_manager(4, [full_attention(2)], 8), ((1, 2),), 2)
    ((1,),)
    """
    specs = state.managers.specs
    # Verify that the hit has one entry per group
    if len(blocks) != len(specs):
        raise InvalidHit(f"{len(blocks)} hit lists for {len(specs)} groups")
    out: list[tuple[int, ...]] = []
    for spec, group_blocks in zip(specs, blocks, strict=True):
        # Verify that the length is a whole number of blocks
        if num_computed_tokens < 0 or num_computed_tokens % spec.block_size != 0:
            raise InvalidTokenCount(
                f"num_computed_tokens={num_computed_tokens} is not a whole number of "
                f"{spec.block_size}-token blocks"
            )
        count = num_computed_tokens // spec.block_size
        if spec.attention is AttentionType.MAMBA:
            count = min(count, len(group_blocks))
        # Verify that the hit covers the length
        elif count > len(group_blocks):
            raise InvalidHit(f"a hit of {len(group_blocks)} blocks cannot cover {count}")
        out.append(tuple(group_blocks[:count]))
    return tuple(out)


def take_new_block_ids(state: KVCacheManagerState) -> tuple[KVCacheManagerState, tuple[int, ...]]:
    """The blocks to zero recorded since the last call (copy destinations; beside a Mamba group,
    every attention group's new blocks), and forget them.

    Group by group (each group's own list, as vLLM keeps one per manager), each
    group's in the order recorded.

    >>> from kvpool.model.single_type import full_attention
    >>> take_new_block_ids(new_kv_cache_manager(4, [full_attention(2)], 8))[1]
    ()
    """
    ordered = sorted(state.new_block_ids, key=lambda entry: entry[0])
    return replace(state, new_block_ids=()), tuple(block for _, block in ordered)


def records_new_block_ids(specs: Sequence[KVCacheSpec], group: int) -> bool:
    """Whether the group's new blocks are recorded for zeroing: an attention group (not Mamba)
    of a configuration with a Mamba group, whose state is read before it is fully written.

    vLLM 0.33.0: ``KVCacheConfig.needs_kv_cache_zeroing`` (Mamba layers, or mixed precision,
    which kvpool's groups never have) in ``vllm/v1/kv_cache_interface.py``, read by each
    ``SingleTypeKVCacheManager`` for ``AttentionSpec`` groups only
    (``vllm/v1/core/single_type_kv_cache_manager.py``).

    >>> from kvpool.model.single_type import full_attention, mamba
    >>> records_new_block_ids([full_attention(16), mamba(16)], 0)
    True
    """
    has_mamba = any(s.attention is AttentionType.MAMBA for s in specs)
    return has_mamba and specs[group].attention is not AttentionType.MAMBA


def estimate_cached_tokens(state: KVCacheManagerState, request_id: str) -> int:
    """The fewest tokens any group's blocks of the request are cached for.

    Per group: the most tokens a primary key of one of its blocks covers;
    over groups: the least (0 when the request holds nothing).

    >>> from kvpool.model.single_type import full_attention
    >>> estimate_cached_tokens(new_kv_cache_manager(4, [full_attention(2)], 8), "r")
    0
    """
    cached: int | None = None
    layout = state.config.hisparse
    for g, table in enumerate(state.managers.tables):
        pool = state.managers.pool
        if layout is not None:
            # HiSparse: resident and hot groups are not prefix-cacheable; the source's
            # blocks are the host pool's (vLLM 0.33.0 KVCacheManager.estimate_cached_tokens)
            if g in layout.residents or g in layout.hots:
                continue
            if g == layout.source and state.host_pool is not None:
                pool = state.host_pool
        group = max(
            (pool.blocks[b].hash_num_tokens or 0 for b in table.req_to_blocks.get(request_id, ())),
            default=0,
        )
        cached = group if cached is None else min(cached, group)
    return cached or 0


def new_step_starts(state: KVCacheManagerState) -> tuple[KVCacheManagerState, None]:
    """A scheduler step begins: Mamba "align" groups forget which states were cached in the
    last one (``kvpool.model.mamba_align.new_step``); no other group keeps per-step state.

    >>> from kvpool.model.single_type import full_attention
    >>> m = new_kv_cache_manager(4, [full_attention(2)], 8)
    >>> new_step_starts(m)[0] == m
    True
    """
    m = state.managers
    tables = tuple(replace(t, align=mamba_align.new_step(t.align)) for t in m.tables)
    return replace(state, managers=replace(m, tables=tables)), None


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
