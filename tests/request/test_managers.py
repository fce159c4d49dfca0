"""The single-type managers, one attention type at a time, on the seeds' worked examples."""

import pytest

from kvpool.model.errors import (
    HitOnRunningRequest,
    InvalidManagerConfig,
    InvalidTokenCount,
    UnknownGroup,
    UnknownRequest,
)
from kvpool.model.pool import evict_blocks, new_pool
from kvpool.model.request import Request, new_request
from kvpool.model.single_type import (
    KVCacheSpec,
    ManagersState,
    allocate_new_blocks,
    cache_blocks,
    chunked_local,
    find_longest_cache_hit,
    free,
    full_attention,
    get_num_blocks_to_allocate,
    get_num_common_prefix_blocks,
    mamba,
    new_managers,
    remove_skipped_blocks,
    save_new_computed_blocks,
    sliding_window,
)
from kvpool.model.state import NULL_BLOCK_ID as NULL

TOKENS = list(range(10, 34))  # 24 distinct tokens


def computed(
    spec: KVCacheSpec, num_blocks: int, tokens: list[int], free_after: bool = True
) -> tuple[ManagersState, Request]:
    """Managers where request "a" computed and cached ``tokens`` (then freed them)."""
    m = new_managers(new_pool(num_blocks, hash_block_size=spec.block_size), [spec])
    a = new_request("a", tokens, spec.block_size)
    m, _ = save_new_computed_blocks(m, 0, "a", [])
    m, _ = allocate_new_blocks(m, 0, "a", len(tokens))
    m, _ = cache_blocks(m, 0, a, len(tokens))
    if free_after:
        m, _ = free(m, 0, "a")
    return m, a


# --------------------------------------------------------------------------
# Hits
# --------------------------------------------------------------------------


def test_full_attention_hit_is_the_longest_cached_prefix() -> None:
    m, a = computed(full_attention(4), 8, TOKENS[:16])  # blocks 1..4 cached
    assert find_longest_cache_hit(m.pool, full_attention(4), a.block_hashes, 16, [0]) == (
        (1, 2, 3, 4),
    )
    assert find_longest_cache_hit(m.pool, full_attention(4), a.block_hashes, 15, [0]) == (
        (1, 2, 3),
    )
    pool, _ = evict_blocks(m.pool, {2})  # a gap: everything after it misses too
    assert find_longest_cache_hit(pool, full_attention(4), a.block_hashes, 16, [0]) == ((1,),)


def test_full_attention_with_eagle_drops_the_last_matched_block() -> None:
    m, a = computed(full_attention(4), 8, TOKENS[:16])
    hit = find_longest_cache_hit(m.pool, full_attention(4), a.block_hashes, 16, [0], use_eagle=True)
    assert hit == ((1, 2, 3),)
    none = find_longest_cache_hit(m.pool, full_attention(4), a.block_hashes[:0], 16, [0], True)
    assert none == ((),)


def test_a_hit_is_common_to_every_group_searched() -> None:
    spec = full_attention(2)
    m = new_managers(new_pool(8, hash_block_size=2), [spec, spec])
    a = new_request("a", TOKENS[:4], 2)
    for g in (0, 1):
        m, _ = save_new_computed_blocks(m, g, "a", [])
        m, _ = allocate_new_blocks(m, g, "a", 4)
    m, _ = cache_blocks(m, 0, a, 4)
    m, _ = cache_blocks(m, 1, a, 2)  # group 1 caches only the first block
    assert find_longest_cache_hit(m.pool, spec, a.block_hashes, 4, [0, 1]) == ((1,), (3,))


def test_sliding_window_seed_example_trims_trailing_blocks() -> None:
    """Window 8, blocks of 4: two contiguous blocks hit; [N, N, 8, 3, N, 9] -> [N, N, 8, 3]."""
    spec = sliding_window(4, 8)
    m, a = computed(spec, 10, TOKENS[:24])  # blocks 1..6 for indices 0..5
    pool, _ = evict_blocks(m.pool, {1, 2, 5})  # indices 0, 1 and 4 miss
    hit = find_longest_cache_hit(pool, spec, a.block_hashes, 24, [0])
    assert hit == ((NULL, NULL, 3, 4),)


def test_sliding_window_without_a_full_window_takes_the_run_from_the_start() -> None:
    spec = sliding_window(4, 9)  # needs cdiv(8, 4) = 2 contiguous blocks
    m, a = computed(spec, 10, TOKENS[:16])
    pool, _ = evict_blocks(m.pool, {2, 4})  # hits at indices 0 and 2: no run of two
    assert find_longest_cache_hit(pool, spec, a.block_hashes, 16, [0]) == ((1,),)
    pool, _ = evict_blocks(m.pool, {1})
    assert find_longest_cache_hit(pool, spec, a.block_hashes, 16, [0]) == ((NULL, NULL, 3, 4),)


def test_sliding_window_with_eagle_needs_one_more_block_then_drops_it() -> None:
    spec = sliding_window(4, 5)  # one block covers the window; EAGLE needs two
    m, a = computed(spec, 10, TOKENS[:16])
    pool, _ = evict_blocks(m.pool, {3})  # indices 0, 1 and 3 hit
    assert find_longest_cache_hit(pool, spec, a.block_hashes, 16, [0]) == ((NULL, NULL, NULL, 4),)
    eagle = find_longest_cache_hit(pool, spec, a.block_hashes, 16, [0], use_eagle=True)
    assert eagle == ((1,),)


@pytest.mark.parametrize(
    ("max_length", "expected"),
    [(15, (NULL, NULL, 3)), (16, (NULL, NULL, NULL, NULL)), (7, (1,)), (0, ())],
    ids=["seed-example-1", "seed-example-2", "first-chunk", "nothing"],
)
def test_chunked_local_seed_examples(max_length: int, expected: tuple[int, ...]) -> None:
    """Chunk 8, blocks of 4: blocks of earlier chunks count as computed (null)."""
    spec = chunked_local(4, 8)
    m, a = computed(spec, 10, TOKENS[:20])
    assert find_longest_cache_hit(m.pool, spec, a.block_hashes, max_length, [0]) == (expected,)


def test_mamba_never_hits() -> None:
    m, a = computed(full_attention(4), 8, TOKENS[:16])
    assert find_longest_cache_hit(m.pool, mamba(16), a.block_hashes, 16, [0]) == ((),)


def test_invalid_alignment_not_a_whole_number_of_blocks() -> None:
    pool = new_pool(4)
    for alignment in (-2, 3):
        with pytest.raises(InvalidTokenCount):
            find_longest_cache_hit(pool, full_attention(2), [], 1, [0], False, alignment)


def test_invalid_mask_alignment_negative() -> None:
    m = new_managers(new_pool(4), [sliding_window(1, 1)])
    m, _ = save_new_computed_blocks(m, 0, "r", [])
    with pytest.raises(InvalidTokenCount):
        cache_blocks(m, 0, new_request("r", [1], 1), 1, mask_alignment=-1)


def test_search_preconditions() -> None:
    pool = new_pool(4)
    with pytest.raises(UnknownGroup):
        find_longest_cache_hit(pool, full_attention(1), [], 1, [])
    with pytest.raises(InvalidTokenCount):
        find_longest_cache_hit(pool, full_attention(1), [], -1, [0])


# --------------------------------------------------------------------------
# Allocation, caching, freeing
# --------------------------------------------------------------------------


def test_a_free_hit_costs_a_block_and_the_null_block_costs_nothing() -> None:
    m, _a = computed(full_attention(4), 8, TOKENS[:16])
    # 20 tokens need 5 blocks: 2 hits, 3 new, and both hits are free (eviction candidates)
    assert get_num_blocks_to_allocate(m, 0, "b", 20, [1, 2]) == 3 + 2
    assert get_num_blocks_to_allocate(m, 0, "b", 20, [NULL, NULL]) == 3


def test_a_request_that_shrinks_needs_no_blocks() -> None:
    m, _ = computed(full_attention(4), 8, TOKENS[:16], free_after=False)
    assert get_num_blocks_to_allocate(m, 0, "a", 5, []) == 0


def test_hits_only_start_a_new_table() -> None:
    m, _ = computed(full_attention(4), 8, TOKENS[:8], free_after=False)
    with pytest.raises(HitOnRunningRequest):
        save_new_computed_blocks(m, 0, "a", [1])
    assert save_new_computed_blocks(m, 0, "a", [])[0] == m


def test_cache_blocks_never_goes_back_and_stops_at_the_hashes() -> None:
    spec = full_attention(2)
    m = new_managers(new_pool(8, hash_block_size=2), [spec])
    a = new_request("a", TOKENS[:5], 2)  # two full hash blocks
    m, _ = save_new_computed_blocks(m, 0, "a", [])
    m, _ = allocate_new_blocks(m, 0, "a", 8)
    m, _ = cache_blocks(m, 0, a, 8)  # only 4 tokens are hashed
    assert m.tables[0].num_cached_block["a"] == 2
    again, _ = cache_blocks(m, 0, a, 2)
    assert again == m
    with pytest.raises(UnknownRequest):
        cache_blocks(m, 0, new_request("b", [1], 2), 1)


def test_mamba_never_caches() -> None:
    m = new_managers(new_pool(4, hash_block_size=2), [mamba(16)])
    a = new_request("a", TOKENS[:16], 2)
    m, _ = save_new_computed_blocks(m, 0, "a", [])
    m, blocks = allocate_new_blocks(m, 0, "a", 16)
    m, _ = cache_blocks(m, 0, a, 16)
    assert blocks == (1,) and not m.pool.cached


def test_free_releases_the_tail_first() -> None:
    m, _ = computed(full_attention(1), 6, TOKENS[:3], free_after=False)
    m, _ = free(m, 0, "a")
    assert m.pool.free_queue == (4, 5, 3, 2, 1)
    assert "a" not in m.tables[0].req_to_blocks
    assert free(m, 0, "a")[0] == m  # freeing a request holding nothing is not an error


def test_sliding_window_releases_blocks_before_the_window() -> None:
    spec = sliding_window(2, 3)
    m = new_managers(new_pool(8, hash_block_size=2), [spec])
    m, _ = save_new_computed_blocks(m, 0, "a", [])
    m, _ = allocate_new_blocks(m, 0, "a", 8)  # blocks 1..4
    m, _ = remove_skipped_blocks(m, 0, "a", 5)  # next token 5 attends to 3..5: block 0 goes
    assert m.tables[0].req_to_blocks["a"] == (NULL, 2, 3, 4)
    m, _ = remove_skipped_blocks(m, 0, "a", 8)  # attends to 6..8: blocks 1 and 2 go too
    assert m.tables[0].req_to_blocks["a"] == (NULL, NULL, NULL, 4)
    assert m.pool.free_queue[:3] == (3, 2, 1)  # released from the window edge backwards


def test_chunked_local_releases_the_last_cached_block_of_an_earlier_chunk() -> None:
    """vLLM 0.33.0: every block of an earlier chunk goes (0.10.1.1 kept the last cached one)."""
    spec = chunked_local(2, 4)
    m, _a = computed(spec, 8, TOKENS[:6], free_after=False)  # 3 blocks, all cached
    m, _ = remove_skipped_blocks(m, 0, "a", 8)  # chunk 2 starts at block 4
    assert m.tables[0].req_to_blocks["a"] == (NULL, NULL, NULL)
    assert m.pool.free_queue[-3:] == (3, 2, 1)  # released from the chunk edge backwards


def test_common_prefix_counts_blocks_every_running_request_holds() -> None:
    m, _a = computed(full_attention(2), 8, TOKENS[:6], free_after=False)
    m, _ = save_new_computed_blocks(m, 0, "b", [1, 2])
    assert get_num_common_prefix_blocks(m, 0, "a", 2) == 0  # hits are not touched here
    assert get_num_common_prefix_blocks(m, 0, "a", 1) == 3
    assert (
        get_num_common_prefix_blocks(new_managers(new_pool(4), [sliding_window(1, 2)]), 0, "a", 1)
        == 0
    )


def test_manager_configuration_is_validated() -> None:
    with pytest.raises(InvalidManagerConfig):
        new_managers(new_pool(4, hash_block_size=2), [full_attention(3)])
    with pytest.raises(InvalidManagerConfig):
        new_managers(new_pool(4), [sliding_window(2, 0)])
    with pytest.raises(InvalidManagerConfig):
        new_managers(new_pool(4), [chunked_local(2, 0)])
    with pytest.raises(InvalidManagerConfig):
        new_managers(new_pool(4), [])
    with pytest.raises(UnknownGroup):
        free(new_managers(new_pool(4), [full_attention(1)]), 1, "a")
