"""The KV cache manager model: hits, allocate_slots, free, stats and metrics."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.model.errors import (
    CachingDisabled,
    HashBlockSizeMismatch,
    HitOnRunningRequest,
    InvalidHit,
    InvalidManagerConfig,
    InvalidTokenCount,
    NoNewTokens,
    UnknownBlock,
)
from kvpool.model.manager import (
    KVCacheManagerState,
    PrefixCacheStats,
    PrefixCachingMetrics,
    allocate_slots,
    cache_blocks,
    find_hit,
    free,
    get_block_ids,
    get_computed_blocks,
    get_num_common_prefix_blocks,
    hit_rate,
    make_prefix_cache_stats,
    new_kv_cache_manager,
    num_free_blocks,
    observe,
    record,
    reset_prefix_cache,
    running_request_ids,
)
from kvpool.model.pool import evict_blocks
from kvpool.model.request import Request, new_request, preempted, with_computed
from kvpool.model.single_type import (
    chunked_local,
    full_attention,
    mamba,
    remove_skipped_blocks,
    sliding_window,
)
from kvpool.model.state import NULL_BLOCK_ID as NULL

TOKENS = tuple(range(10, 42))


def run(state: KVCacheManagerState, request: Request) -> KVCacheManagerState:
    """Admit ``request`` with its hits and compute its whole prompt in one step."""
    state, (hit, n) = get_computed_blocks(state, request)
    state, blocks = allocate_slots(state, request, request.num_tokens - n, n, hit)
    assert blocks is not None
    return state


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    m = new_kv_cache_manager(10, [full_attention(4)], 32)
    m = run(m, new_request("a", TOKENS[:8], 4))
    m, _ = free(m, "a")
    _, (hit, n) = get_computed_blocks(m, new_request("b", TOKENS[:8], 4))
    assert (hit, n) == (((1,),), 4)  # capped at 7 tokens: one whole block
    _, (hit, n) = get_computed_blocks(m, new_request("c", TOKENS[:9], 4))
    assert (hit, n) == (((1, 2),), 8)


def test_no_lookup_without_caching_or_for_requests_that_skip_it() -> None:
    m = new_kv_cache_manager(10, [full_attention(4)], 32, log_stats=True)
    m = run(m, new_request("a", TOKENS[:8], 4))
    skipping = new_request("b", TOKENS[:9], 4, skip_reading_prefix_cache=True)
    after, result = get_computed_blocks(m, skipping)
    assert result == (((),), 0) and after == m  # not even counted in the stats
    off = new_kv_cache_manager(10, [full_attention(4)], 32, enable_caching=False)
    off = run(off, new_request("a", TOKENS[:8], 4))
    assert not off.managers.pool.cached
    assert get_computed_blocks(off, new_request("b", TOKENS[:9], 4))[1] == (((),), 0)


def test_a_refused_allocation_changes_nothing() -> None:
    m = new_kv_cache_manager(4, [full_attention(2)], 32)
    m = run(m, new_request("a", TOKENS[:4], 2))
    request = new_request("b", TOKENS[10:20], 2)
    assert allocate_slots(m, request, 10) == (m, None)


@given(
    st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=9), min_size=1, max_size=4),
    st.integers(2, 10),
    st.integers(1, 3),
)
def test_refusal_changes_nothing_but_the_window(
    prompts: list[list[int]], num_blocks: int, window: int
) -> None:
    """Whatever the state, a refused allocate_slots only releases blocks that left the window."""
    for spec in (full_attention(2), sliding_window(2, window)):
        m = new_kv_cache_manager(num_blocks, [spec], 32)
        for i, prompt in enumerate(prompts):
            request = new_request(f"r{i}", prompt, 2)
            m, (hit, n) = get_computed_blocks(m, request)
            before = m
            m, blocks = allocate_slots(m, request, request.num_tokens - n, n, hit)
            if blocks is None:
                managers, _ = remove_skipped_blocks(before.managers, 0, request.request_id, 0)
                assert m == replace(before, managers=managers)


def test_sliding_window_releases_blocks_even_when_refusing() -> None:
    m = new_kv_cache_manager(6, [sliding_window(2, 2)], 32)
    a = new_request("a", TOKENS[:8], 2)
    m, _ = allocate_slots(m, a, 8)  # blocks 1..4
    m, blocks = allocate_slots(m, with_computed(a, 8), 20)  # far too many
    assert blocks is None
    assert get_block_ids(m, "a") == ((NULL, NULL, NULL, 4),)  # the window moved anyway


def test_lookahead_slots_are_allocated_but_capped_at_max_model_len() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 10)
    a = new_request("a", TOKENS[:4], 2)
    m, blocks = allocate_slots(m, a, 4, num_lookahead_tokens=3)
    assert blocks == ((1, 2, 3, 4),)  # 7 slots
    m, blocks = allocate_slots(m, with_computed(a, 4), 4, num_lookahead_tokens=8)
    assert blocks == ((5,),)  # 16 slots asked, 10 given


def test_draft_tokens_are_never_cached() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 32)
    a = new_request("a", TOKENS[:5], 2)
    m, _ = allocate_slots(m, a, 5 + 3)  # the prompt and three draft tokens
    assert m.managers.tables[0].num_cached_block["a"] == 2  # tokens 0..3 only


def test_a_chunk_caches_only_what_it_computes() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 32)
    a = new_request("a", TOKENS[:8], 2)
    m, _ = allocate_slots(m, a, 3, num_lookahead_tokens=4)
    assert m.managers.tables[0].num_cached_block["a"] == 1  # 3 tokens computed: 1 full block


def test_delayed_caching_waits_for_cache_blocks() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 32)
    a = new_request("a", TOKENS[:4], 2)
    m, _ = allocate_slots(m, a, 4, delay_cache_blocks=True)
    assert not m.managers.pool.cached
    m, _ = cache_blocks(m, a, 4)
    assert len(m.managers.pool.cached) == 2


def test_a_hit_is_touched_recorded_and_costs_a_block_if_free() -> None:
    m = new_kv_cache_manager(5, [full_attention(2)], 32)
    m = run(m, new_request("a", TOKENS[:4], 2))
    m, _ = free(m, "a")  # blocks 1, 2 cached and free
    b = new_request("b", TOKENS[:6], 2)
    m, (hit, n) = get_computed_blocks(m, b)
    assert (hit, n) == (((1, 2),), 4)
    # 6 tokens: 2 hits + 1 new, and both hits leave the free queue: 3 of 4 free blocks
    m, blocks = allocate_slots(m, b, 2, n, hit)
    assert blocks == ((3,),)
    assert get_block_ids(m, "b") == ((1, 2, 3),)
    assert num_free_blocks(m) == 1
    assert get_num_common_prefix_blocks(m, "b") == (3,)


def test_a_hybrid_hit_is_the_longest_prefix_every_type_accepts() -> None:
    specs = [full_attention(4), sliding_window(4, 5)]
    m = new_kv_cache_manager(20, specs, 32)
    a = new_request("a", TOKENS[:16], 4)
    m = run(m, a)
    m, _ = free(m, "a")
    blocks, n = find_hit(m, a.block_hashes, 15)
    assert n == 12 and blocks[0] == (1, 2, 3) and blocks[1] == (NULL, NULL, 7)
    pool, _ = evict_blocks(m.managers.pool, {7})  # the window's block for tokens 8..11
    m2 = replace(m, managers=replace(m.managers, pool=pool))
    blocks, n = find_hit(m2, a.block_hashes, 15)
    assert n == 8 and blocks == ((1, 2), (NULL, 6))


def test_free_releases_every_group_and_tolerates_strangers() -> None:
    m = new_kv_cache_manager(20, [full_attention(2), sliding_window(2, 3)], 32)
    m = run(m, new_request("a", TOKENS[:4], 2))
    assert running_request_ids(m) == {"a"}
    m, _ = free(m, "a")
    assert running_request_ids(m) == frozenset() and num_free_blocks(m) == 19
    assert free(m, "a")[0] == m


def test_stats_count_lookups_and_preempted_requests_apart() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 32, log_stats=True)
    m = run(m, new_request("a", TOKENS[:4], 2))
    m, _ = free(m, "a")
    b = new_request("b", TOKENS[:5], 2)
    m, _ = get_computed_blocks(m, b)
    m, _ = get_computed_blocks(m, preempted(b))
    m, stats = make_prefix_cache_stats(m)
    assert stats == PrefixCacheStats(False, 2, 9, 4, 1, 5, 4)
    assert m.stats == PrefixCacheStats()
    m, done = reset_prefix_cache(m)
    assert done and m.stats == PrefixCacheStats(reset=True)


def test_preconditions_of_allocate_slots() -> None:
    m = new_kv_cache_manager(20, [full_attention(2)], 32)
    a = new_request("a", TOKENS[:4], 2)
    with pytest.raises(NoNewTokens):
        allocate_slots(m, a, 0)
    with pytest.raises(InvalidTokenCount):
        allocate_slots(m, a, 1, num_lookahead_tokens=-1)
    with pytest.raises(InvalidHit):
        allocate_slots(m, a, 1, 0, ((), ()))
    with pytest.raises(UnknownBlock):
        allocate_slots(m, a, 1, 2, ((99,),))
    with pytest.raises(HashBlockSizeMismatch):
        allocate_slots(m, new_request("a", TOKENS[:4], 1), 1)
    m2, _ = allocate_slots(m, a, 2)
    with pytest.raises(HitOnRunningRequest):
        allocate_slots(m2, a, 1, 2, ((1,),))
    off = new_kv_cache_manager(20, [full_attention(2)], 32, enable_caching=False)
    with pytest.raises(CachingDisabled):
        allocate_slots(off, a, 1, 2, ((1,),))


@pytest.mark.parametrize(
    "build",
    [
        lambda: new_kv_cache_manager(4, [full_attention(2)], 0),
        lambda: new_kv_cache_manager(4, [], 8),
        lambda: new_kv_cache_manager(
            4, [full_attention(2), sliding_window(4, 2)], 8, scheduler_block_size=6
        ),
        lambda: new_kv_cache_manager(4, [mamba(4)], 8),
        lambda: new_kv_cache_manager(4, [chunked_local(2, 4)], 8, use_eagle=True),
        lambda: new_kv_cache_manager(
            4, [full_attention(2), chunked_local(2, 4)], 8, use_eagle=True
        ),
        lambda: new_kv_cache_manager(
            4, [full_attention(2)], 8, use_eagle=True, num_prefill_lookahead=3
        ),
        lambda: new_kv_cache_manager(4, [full_attention(2)], 8, num_prefill_lookahead=-1),
        lambda: new_kv_cache_manager(4, [full_attention(2)], 8, num_prefill_lookahead=1.0),  # type: ignore[arg-type]
        lambda: new_kv_cache_manager(0, [full_attention(2)], 8),
        lambda: new_kv_cache_manager(4, [full_attention(3)], 8, hash_block_size=2),
    ],
    ids=[
        "max-model-len",
        "no-group",
        "scheduler-not-a-multiple",
        "mamba-too-small",
        "eagle-chunked",
        "eagle-hybrid-chunked",
        "lookahead-past-a-block",
        "lookahead-negative",
        "lookahead-not-an-int",
        "no-blocks",
        "not-a-multiple",
    ],
)
def test_invalid_configurations(build: object) -> None:
    with pytest.raises(InvalidManagerConfig):
        build()  # type: ignore[operator]


def test_metrics_keep_about_the_last_n_requests() -> None:
    one = record(PrefixCacheStats(), 10, 5, preempted=False)
    metrics = PrefixCachingMetrics(max_recent_requests=2)
    metrics = observe(metrics, one)
    metrics = observe(metrics, PrefixCacheStats())  # no request: not added
    assert metrics.window == ((1, 10, 5),)
    metrics = observe(metrics, record(one, 10, 0, preempted=False))
    assert metrics.window == ((2, 20, 5),) and hit_rate(metrics) == 0.25
    big = record(record(record(PrefixCacheStats(), 4, 4, False), 4, 4, False), 4, 4, False)
    metrics = observe(metrics, big)  # three requests alone: kept anyway
    assert metrics.window == ((3, 12, 12),) and hit_rate(metrics) == 1.0
    metrics = observe(metrics, replace(one, reset=True))
    assert metrics.window == ((1, 10, 5),)
    with pytest.raises(InvalidManagerConfig):
        observe(PrefixCachingMetrics(0), one)
