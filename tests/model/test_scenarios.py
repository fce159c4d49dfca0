"""Worked stories: several operations in a row, every invariant checked after each step.

Each test drives a pool through ``Run``, which runs specs.invariants.check_all
(with LRU history and the events taken so far) after every operation.
"""

import pytest

from kvpool.model import (
    APPEND,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockState,
    BlockStored,
    CacheRequest,
    CachingDisabled,
    cache_full_blocks,
    cache_partial_block,
    evict_blocks,
    free_blocks,
    get_cached_block,
    get_new_blocks,
    get_num_free_blocks,
    get_usage,
    new_pool,
    reset_prefix_cache,
    touch,
)
from tests.model.helpers import H0, H1, H2, Run

R1 = CacheRequest(block_hashes=(H0, H1, H2), all_token_ids=(10, 11, 12))


def test_two_requests_sharing_a_prefix_freed_in_reverse_order() -> None:
    """Request 1 fills blocks 1, 2, 3 (hashes h0 h1 h2) and caches them. Request 2
    shares the first two blocks (a cache hit: touch) and gets its own block 4,
    still partially filled and so hash-less. Request 1 finishes and frees its
    blocks tail first: only block 3 drops to zero and goes to the back. Then
    request 2 frees tail first: hash-less block 4 goes to the front, blocks 2
    and 1 to the back, so the shared prefix is the last thing to be evicted."""
    run = Run(new_pool(6))
    r1 = run.do(get_new_blocks, 3)
    assert r1 == (1, 2, 3)
    run.do(cache_full_blocks, R1, r1, 0, 3, 1, 0)

    assert run.ask(get_cached_block, H0, [0]) == (1,)
    assert run.ask(get_cached_block, H1, [0]) == (2,)
    run.do(touch, [1, 2])
    (own,) = run.do(get_new_blocks, 1)
    assert own == 4
    r2 = (1, 2, own)
    assert [b.ref_cnt for b in run.state.blocks] == [0, 2, 2, 1, 1, 0]
    assert run.state.free_queue == (5,)

    run.do(free_blocks, list(reversed(r1)))
    # mypy keeps the narrowing of the assert above across run.do, which replaced run.state
    assert run.state.free_queue == (5, 3)  # type: ignore[comparison-overlap]
    assert [b.ref_cnt for b in run.state.blocks] == [0, 1, 1, 0, 1, 0]

    run.do(free_blocks, list(reversed(r2)))
    assert run.state.free_queue == (4, 5, 3, 2, 1)  # type: ignore[comparison-overlap]
    assert all(b.ref_cnt == 0 for b in run.state.blocks)
    assert dict(run.state.cached) == {(H0, 0): (1,), (H1, 0): (2,), (H2, 0): (3,)}


def test_touching_an_eviction_candidate_takes_it_off_the_queue_with_its_hash() -> None:
    """A finished request left blocks 1 and 2 cached in the free queue. A new
    request hits h0, finds block 1 and touches it: block 1 leaves the queue,
    keeps its hash, and the next allocation no longer hands it out."""
    run = Run(new_pool(4))
    ids = run.do(get_new_blocks, 2)
    run.do(cache_full_blocks, R1, ids, 0, 2, 1, 0)
    run.do(free_blocks, [2, 1])
    assert run.state.free_queue == (3, 2, 1)

    hit = run.ask(get_cached_block, H0, [0])
    assert hit == (1,)
    run.do(touch, hit)
    # mypy keeps the narrowing of the assert above across run.do, which replaced run.state
    assert run.state.free_queue == (3, 2)  # type: ignore[comparison-overlap]
    assert run.state.blocks[1] == BlockState(ref_cnt=1, block_hash=(H0, 0), hash_num_tokens=1)
    assert run.ask(get_cached_block, H0, [0]) == (1,)
    assert run.do(get_new_blocks, 2) == (3, 2)


def test_reset_refused_while_a_block_is_in_use_then_succeeds_after_freeing() -> None:
    """Weights were updated, so the prefix cache must go. While block 2 is still
    held by a running request the reset is refused (False) and the pool is left
    exactly as it was; once the request frees it, the reset clears every hash
    and keeps the queue order."""
    run = Run(new_pool(4, enable_events=True))
    ids = run.do(get_new_blocks, 2)
    run.do(cache_full_blocks, R1, ids, 0, 2, 1, 0)
    run.do(free_blocks, [1])
    before = run.state

    assert run.do(reset_prefix_cache) is False
    assert run.state is before
    assert run.ask(get_cached_block, H1, [0]) == (2,)

    run.do(free_blocks, [2])
    assert run.do(reset_prefix_cache) is True
    assert dict(run.state.cached) == {}
    assert run.state.free_queue == (3, 1, 2)
    assert run.events()[-1] == AllBlocksCleared()


def test_evicted_free_block_keeps_its_place_and_is_hashless_only_for_later_frees() -> None:
    """A KV connector reports block 2 lost. The block is free and cached: evict_blocks
    removes its hash but leaves it where it stands in the free queue (it is not
    moved to the front). Only if it is later taken and freed again does the
    hash-less rule apply, and then it goes to the front."""
    run = Run(new_pool(5))
    ids = run.do(get_new_blocks, 3)
    run.do(cache_full_blocks, R1, ids, 0, 3, 1, 0)
    run.do(free_blocks, [3, 2, 1])
    assert run.state.free_queue == (4, 3, 2, 1)

    run.do(evict_blocks, {2})
    assert run.state.free_queue == (4, 3, 2, 1)
    assert run.state.blocks[2] == BlockState()
    assert run.ask(get_cached_block, H1, [0]) is None

    run.do(touch, [2])
    run.do(free_blocks, [2])
    assert run.state.free_queue == (2, 4, 3, 1)


def test_two_blocks_under_one_hash_serve_the_first_inserted_then_the_second() -> None:
    """Two requests computed the same first block concurrently, so blocks 1 and 2
    both carry h0 (no de-duplication). A lookup returns the one inserted first,
    block 2; once block 2 is evicted, the lookup falls back to block 1."""
    run = Run(new_pool(4, enable_events=True))
    run.do(get_new_blocks, 2)
    run.do(cache_full_blocks, R1, [2], 0, 1, 1, 0)
    run.do(cache_full_blocks, R1, [1], 0, 1, 1, 0)
    assert dict(run.state.cached) == {(H0, 0): (2, 1)}
    assert run.ask(get_cached_block, H0, [0]) == (2,)

    run.do(evict_blocks, {2})
    assert run.ask(get_cached_block, H0, [0]) == (1,)
    run.do(evict_blocks, {1})
    assert run.ask(get_cached_block, H0, [0]) is None


def test_partial_block_is_promoted_to_a_full_block() -> None:
    """Hashes cover 2 tokens, blocks hold 4. After 2 tokens the request registers
    a partial entry for its block (key a); once the block is full,
    cache_full_blocks promotes it: the partial key is removed (BlockRemoved)
    before the full key b (the chained hash of all 4 tokens) is stored (BlockStored)."""
    request = CacheRequest(block_hashes=(b"a", b"b"), all_token_ids=(1, 2, 3, 4))
    run = Run(new_pool(3, hash_block_size=2, enable_events=True))
    (b,) = run.do(get_new_blocks, 1)

    assert run.do(cache_partial_block, request, b, 2, 0, 4) == (b"a", 0)
    assert run.state.blocks[b].hash_num_tokens == 2
    assert run.events() == (
        BlockStored((b"a",), None, (1, 2), 2, None, MEDIUM_GPU, None, (None,), 0),
    )

    run.do(cache_full_blocks, request, [b], 0, 1, 4, 0)
    assert run.state.blocks[b] == BlockState(ref_cnt=1, block_hash=(b"b", 0), hash_num_tokens=4)
    assert dict(run.state.cached) == {(b"b", 0): (b,)}
    assert run.events() == (
        BlockRemoved((b"a",), MEDIUM_GPU, 0),
        BlockStored((b"b",), None, (1, 2, 3, 4), 4, None, MEDIUM_GPU, None, (None,), 0),
    )


def test_hashless_blocks_freed_go_to_the_front_by_default_and_to_the_back_under_append() -> None:
    """The same history under two profiles: blocks 1 and 2 are taken, neither is
    cached, and they are freed as [2, 1]. The default (hash-less first) rule puts
    them in front of block 3, ready to be reused first; vLLM 0.8-0.23 appended
    every freed block to the back."""
    default = Run(new_pool(4))
    append = Run(new_pool(4, profile=APPEND))
    for run in (default, append):
        run.do(get_new_blocks, 2)
        run.do(free_blocks, [2, 1])
    assert default.state.free_queue == (2, 1, 3)
    assert append.state.free_queue == (3, 2, 1)


def test_pool_without_prefix_caching() -> None:
    """With prefix caching off the pool is a plain allocator: blocks are handed out
    and freed, nothing can be cached, every lookup misses, and a reset trivially
    succeeds once everything is free."""
    run = Run(new_pool(4, enable_caching=False, enable_events=True))
    ids = run.do(get_new_blocks, 3)
    assert run.ask(get_usage) == 1.0
    with pytest.raises(CachingDisabled):
        cache_full_blocks(run.state, R1, ids, 0, 3, 1, 0)
    with pytest.raises(CachingDisabled):
        cache_partial_block(run.state, R1, ids[0], 1, 0, 2)
    run.check()
    assert run.ask(get_cached_block, H0, [0]) is None

    run.do(free_blocks, [3, 1, 2])
    assert run.state.free_queue == (3, 1, 2)
    assert run.ask(get_num_free_blocks) == 3
    assert run.do(reset_prefix_cache) is True
    assert dict(run.state.cached) == {}
    assert run.events() == (AllBlocksCleared(),)


def test_same_hash_cached_in_two_kv_cache_groups() -> None:
    """A hybrid model has two KV cache groups. The same prefix hash h0 is cached in
    group 0 (block 1) and group 1 (block 2). A lookup over both groups hits with
    one block per group; a lookup that also asks for group 2 misses entirely."""
    run = Run(new_pool(4))
    run.do(get_new_blocks, 2)
    run.do(cache_full_blocks, R1, [1], 0, 1, 1, 0)
    run.do(cache_full_blocks, R1, [2], 0, 1, 1, 1)
    assert dict(run.state.cached) == {(H0, 0): (1,), (H0, 1): (2,)}
    assert run.ask(get_cached_block, H0, [0, 1]) == (1, 2)
    assert run.ask(get_cached_block, H0, [0, 1, 2]) is None
    assert run.ask(get_cached_block, H0, [2]) is None

    run.do(evict_blocks, {2})
    assert run.ask(get_cached_block, H0, [0]) == (1,)
    assert run.ask(get_cached_block, H0, [0, 1]) is None


def test_event_stream_for_a_cache_evict_reset_sequence() -> None:
    """A KV-aware router follows the pool through its events: three blocks are
    stored in one BlockStored, block 2 is evicted (one BlockRemoved), and after
    every block is freed the reset emits AllBlocksCleared."""
    run = Run(new_pool(4, enable_events=True))
    ids = run.do(get_new_blocks, 3)
    run.do(cache_full_blocks, R1, ids, 0, 3, 1, 0)
    run.do(evict_blocks, {2})
    run.do(free_blocks, [3, 2, 1])
    assert run.do(reset_prefix_cache) is True
    assert run.events() == (
        BlockStored((H0, H1, H2), None, (10, 11, 12), 1, None, MEDIUM_GPU, None, (None,) * 3, 0),
        BlockRemoved((H1,), MEDIUM_GPU, 0),
        AllBlocksCleared(),
    )
    assert run.events() == ()


def test_allocating_a_cached_free_block_emits_its_removal() -> None:
    """Blocks 1 and 2 are cached and free (1 nearer the front). A new request asks
    for two blocks: block 3 (hash-less, freed to the front) and then block 1,
    whose hash h0 is evicted on the way out, so the router hears BlockRemoved."""
    run = Run(new_pool(4, enable_events=True))
    ids = run.do(get_new_blocks, 3)
    run.do(cache_full_blocks, R1, ids, 0, 2, 1, 0)
    run.do(free_blocks, [1, 2, 3])
    assert run.state.free_queue == (3, 1, 2)
    run.events()

    assert run.do(get_new_blocks, 2) == (3, 1)
    assert run.events() == (BlockRemoved((H0,), MEDIUM_GPU, 0),)
    assert dict(run.state.cached) == {(H1, 0): (2,)}
