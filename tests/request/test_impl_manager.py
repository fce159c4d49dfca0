"""The impl's KVCacheManager against the model where the lock-step machine does not reach.

The machine always builds managers from valid configurations and passes
every argument explicitly; these tests pin down the rest: which
configurations are refused (with the model's exception type), what the
defaults are, and how block lists combine.
"""

import itertools
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvpool.impl import BlockPool
from kvpool.impl.manager import KVCacheBlockCopy, KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.impl.single_type import get_manager_for_kv_cache_spec
from kvpool.model import manager as model_manager
from kvpool.model import pool as pool_ops
from kvpool.model import single_type as single
from kvpool.model.errors import (
    InvalidArgument,
    InvalidBlockRange,
    InvalidHit,
    InvalidTokenCount,
    UnknownGroup,
    UnknownRequest,
)
from kvpool.model.pool import new_pool
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import (
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    mamba_align,
    mamba_reserving,
    sliding_window,
)
from kvpool.specs.request.machine import layout_specs
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import HYBRID_LAYOUTS, ManagerSetup
from kvpool.specs.targets.impl.request import ImplManagerTarget

GROUPS: dict[str, tuple[KVCacheSpec, ...]] = {
    "none": (),
    "full": (full_attention(2),),
    "full-1": (full_attention(1),),
    "two-sizes": (full_attention(2), sliding_window(4, 2)),
    "full+window": (full_attention(2), sliding_window(2, 3)),
    "window-0": (sliding_window(2, 0),),
    "window-1": (sliding_window(2, 1),),
    "chunk-0": (chunked_local(2, 0),),
    "chunk-1": (chunked_local(2, 1),),
    "mamba-7": (mamba(7),),
    "mamba-8": (mamba(8),),
    "chunked": (chunked_local(2, 4),),
    "full+full": (full_attention(2), full_attention(2)),
}


def _outcome(build: object) -> object:
    """The built manager's state, or the type of what building it raised."""
    try:
        built = build()  # type: ignore[operator]
    except Exception as error:
        return type(error)
    return built.snapshot() if isinstance(built, KVCacheManager) else built


@pytest.mark.parametrize(
    ("groups", "max_model_len", "num_blocks", "hbs", "eagle"),
    list(itertools.product(sorted(GROUPS), (0, 1, 8), (0, 1, 2), (None, 1, 2, 3), (False, True))),
)
def test_configurations_are_refused_exactly_as_the_model_refuses_them(
    groups: str, max_model_len: int, num_blocks: int, hbs: int | None, eagle: bool
) -> None:
    specs = GROUPS[groups]
    expected = _outcome(
        lambda: model_manager.new_kv_cache_manager(
            num_blocks, specs, max_model_len, hash_block_size=hbs, use_eagle=eagle
        )
    )
    actual = _outcome(
        lambda: KVCacheManager(
            KVCacheConfig(num_blocks, specs), max_model_len, hash_block_size=hbs, use_eagle=eagle
        )
    )
    assert actual == expected


def test_defaults_are_the_models() -> None:
    specs = (full_attention(2),)
    impl = KVCacheManager(KVCacheConfig(6, specs), 16)
    model = model_manager.new_kv_cache_manager(6, specs, 16)
    assert impl.snapshot() == model
    # Four tokens fill two blocks exactly: one more slot (a computed or
    # look-ahead token by default) would take a third, and the two full
    # blocks are cached at once unless caching is delayed by default.
    request = new_request("a", (1, 2, 3, 4), 2)
    blocks = impl.allocate_slots(request, 4)
    model, expected = model_manager.allocate_slots(model, request, 4)
    assert blocks is not None
    assert tuple(tuple(g) for g in blocks.get_block_ids()) == expected == ((1, 2),)
    assert impl.snapshot() == model


def test_adding_block_lists_joins_them_group_by_group() -> None:
    pool = KVCacheManager(KVCacheConfig(6, (full_attention(2),) * 2), 16).block_pool
    a = KVCacheBlocks(([pool.blocks[1]], [pool.blocks[2]]))
    b = KVCacheBlocks(([pool.blocks[3]], []))
    assert (a + b).get_block_ids() == ([1, 3], [2])


def test_adding_block_lists_of_different_group_counts_is_refused() -> None:
    pool = KVCacheManager(KVCacheConfig(6, (full_attention(2),)), 16).block_pool
    with pytest.raises(ValueError, match="zip"):
        KVCacheBlocks(([pool.blocks[1]],)) + KVCacheBlocks(([], []))


def test_a_block_copy_keeps_its_ends_and_equals_only_a_copy_with_both_the_same() -> None:
    # vLLM 0.33's KVCacheBlockCopy is a NamedTuple (vllm/v1/core/kv_cache_utils.py):
    # its ends are read by name, and two copies are equal exactly when both ends are.
    copy = KVCacheBlockCopy(2, 3)
    assert (copy.src_block_id, copy.dst_block_id) == (2, 3)
    assert copy == KVCacheBlockCopy(2, 3) and hash(copy) == hash(KVCacheBlockCopy(2, 3))
    assert copy != KVCacheBlockCopy(4, 3)
    assert copy != KVCacheBlockCopy(2, 4)


def test_the_manager_keeps_vllms_attributes() -> None:
    config = KVCacheConfig(6, (full_attention(2), sliding_window(2, 3)))
    m = KVCacheManager(config, 16)
    assert m.kv_cache_config is config and m.num_kv_cache_groups == 2


HYBRIDS = ["full+sliding_window", *HYBRID_LAYOUTS]


@given(
    layout=st.sampled_from(HYBRIDS),
    hbs=st.integers(1, 2),
    window=st.integers(1, 6),
    chunk_blocks=st.integers(1, 3),
    prompt=st.lists(st.integers(1, 2), min_size=1, max_size=16),
    extra=st.lists(st.integers(1, 2), max_size=3),
    evicted=st.sets(st.integers(1, 39), max_size=12),
)
# Three kinds take more than one round: the first window's hit (6 tokens, found while the
# second window still allowed 6) must be searched again at the second's (2 tokens).
@example(
    layout="full+sliding_window+sliding_window",
    hbs=1,
    window=1,
    chunk_blocks=1,
    prompt=[1] * 7,
    extra=[],
    evicted={10},
)
def test_a_hybrid_hit_after_any_evictions_is_the_models(
    layout: str,
    hbs: int,
    window: int,
    chunk_blocks: int,
    prompt: list[int],
    extra: list[int],
    evicted: set[int],
) -> None:
    """Evicting blocks of one group and not another makes the types disagree on the hit:
    the search must then shorten the candidate in turns until every type accepts it."""
    specs = layout_specs(layout, hbs * 2, window, chunk_blocks, 32, hbs)
    impl = KVCacheManager(KVCacheConfig(40, specs), 32, hash_block_size=hbs)
    model = model_manager.new_kv_cache_manager(40, specs, 32, hash_block_size=hbs)
    first = new_request("a", prompt, hbs)
    assert impl.allocate_slots(first, len(prompt)) is not None
    model, _ = model_manager.allocate_slots(model, first, len(prompt))
    impl.free(first)
    model, _ = model_manager.free(model, "a")
    impl.evict_blocks(evicted)
    model, _ = model_manager.evict_blocks(model, evicted)
    probe = new_request("b", prompt + extra, hbs)
    blocks, num_tokens, _ = impl.get_computed_blocks(probe)
    _, expected = model_manager.get_computed_blocks(model, probe)
    assert (tuple(tuple(g) for g in blocks.get_block_ids()), num_tokens) == expected


def _single_type_pair(spec: KVCacheSpec, num_blocks: int = 12) -> tuple[Any, Any, BlockPool]:
    """A one-group model state and the impl's single-type manager over an equal pool."""
    state = single.new_managers(new_pool(num_blocks, True, 1), [spec])
    pool = BlockPool(num_blocks, True, 1)
    return state, get_manager_for_kv_cache_spec(spec, pool, 0), pool


def test_chunked_local_without_a_cached_block_releases_every_earlier_chunk() -> None:
    """Nothing cached (caching delayed or off): no last cached block is kept back."""
    state, impl, pool = _single_type_pair(chunked_local(1, 2))
    state, _ = single.save_new_computed_blocks(state, 0, "r", ())
    state, _ = single.allocate_new_blocks(state, 0, "r", 5)
    impl.save_new_computed_blocks("r", [])
    impl.allocate_new_blocks("r", 5)
    state, _ = single.remove_skipped_blocks(state, 0, "r", 5)
    impl.remove_skipped_blocks("r", 5)
    assert impl.table() == state.tables[0]
    assert impl.table().req_to_blocks["r"] == (0, 0, 0, 0, 5)
    assert pool.snapshot() == state.pool


def test_a_sliding_window_hit_stops_at_a_hole_in_the_cache() -> None:
    """A window needing three blocks over a prefix cached as [1, 2, hole, 4, 5]: the run at
    the end is too short, so the search starts over before the hole and settles for the
    run from the start (a window not yet full)."""
    spec = sliding_window(1, 4)
    state, impl, pool = _single_type_pair(spec)
    request = new_request("r", (1, 2, 3, 4, 5), 1)
    state, _ = single.save_new_computed_blocks(state, 0, "r", ())
    state, _ = single.allocate_new_blocks(state, 0, "r", 5)
    state, _ = single.cache_blocks(state, 0, request, 5)
    impl.save_new_computed_blocks("r", [])
    impl.allocate_new_blocks("r", 5)
    impl.cache_blocks(request, 5)
    hole = {impl.req_to_blocks["r"][2].block_id}
    state = single.ManagersState(
        pool_ops.evict_blocks(state.pool, hole)[0], state.specs, state.tables
    )
    pool.evict_blocks(hole)
    expected = single.find_longest_cache_hit(state.pool, spec, request.block_hashes, 5, [0])
    found = type(impl).find_longest_cache_hit(request.block_hashes, 5, [0], pool, spec, False)
    assert tuple(tuple(b.block_id for b in g) for g in found) == expected
    assert expected == ((1, 2),)


def test_a_request_without_the_skip_flag_reads_the_cache() -> None:
    """Requests are duck-typed: one with no ``skip_reading_prefix_cache`` is not skipping."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    first = new_request("a", (1, 2, 3, 4, 5), 2)
    impl.allocate_slots(first, 5)
    impl.free(first)
    probe = new_request("b", (1, 2, 3, 4, 5), 2)
    read = ("request_id", "hash_block_size", "num_tokens", "block_hashes", "num_preemptions")
    duck = SimpleNamespace(**{name: getattr(probe, name) for name in read})
    blocks, num_tokens, _ = impl.get_computed_blocks(duck)
    assert blocks.get_block_ids() == ([1, 2],) and num_tokens == 4


@pytest.mark.parametrize("eagle", [False, True])
def test_the_prompt_tail_is_keyed_beside_the_full_key_in_model_and_impl(eagle: bool) -> None:
    """Blocks of two hash blocks: the prompt's last hit-able boundary (10 of 12 tokens, all 12
    with EAGLE: on a block boundary, so nothing) is keyed once its block is full (vLLM 0.33)."""
    from kvpool.model.events import BlockStored
    from kvpool.model.request import with_computed
    from kvpool.specs.request.model_target import ModelManagerTarget
    from kvpool.specs.request.target import ManagerSetup
    from kvpool.specs.targets.impl.request import ImplManagerTarget

    setup = ManagerSetup(8, (full_attention(4),), 16, 2, use_eagle=eagle, enable_events=True)
    request = new_request("r", (1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1), 2)
    tails = []
    for target in (ModelManagerTarget(setup), ImplManagerTarget(setup)):
        target.allocate_slots(request, 10)
        before = target.snapshot().managers.pool
        target.allocate_slots(with_computed(request, 10), 2)
        after = target.snapshot()
        events = target.take_events()
        tails.append(
            (
                after,
                [
                    e.block_hashes
                    for e in events
                    if isinstance(e, BlockStored) and e.block_size == 2
                ],
                len(before.cached),
            )
        )
    assert tails[0] == tails[1]
    _, stored, cached_before = tails[0]
    assert cached_before == 2  # only the two full blocks while block 3 is partly written
    assert stored == ([] if eagle else [(request.block_hashes[4],)])


def test_with_fine_grained_hits_the_prompt_tail_is_keyed_before_its_block_is_full() -> None:
    """Fine-grained hits: the cached tokens are not rounded down to the block size (vLLM 0.33's
    ``_align_cacheable``), so the tail's key (10 of 12 tokens) arrives with the allocation that
    computes it, in model and impl alike. Filling the block promotes it to its full key (the
    partial key removed, as vLLM's ``cache_full_blocks`` does), and the tail is keyed again."""
    from kvpool.model.events import BlockRemoved, BlockStored
    from kvpool.model.request import with_computed
    from kvpool.specs.request.model_target import ModelManagerTarget
    from kvpool.specs.request.target import ManagerSetup
    from kvpool.specs.targets.impl.request import ImplManagerTarget

    specs = (full_attention(4), full_attention(4))
    setup = ManagerSetup(12, specs, 16, 2, enable_events=True, fine_grained_hits=True)
    request = new_request("r", (1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1), 2)
    seen: list[tuple[object, list[list[tuple[str, int, tuple[bytes, ...]]]]]] = []
    for target in (ModelManagerTarget(setup), ImplManagerTarget(setup)):
        target.allocate_slots(request, 10)
        first_taken = target.take_events()
        target.allocate_slots(with_computed(request, 10), 2)
        second_taken = target.take_events()
        # events are on: stores and removals, none cleared
        taken = cast(list[Sequence[BlockStored | BlockRemoved]], [first_taken, second_taken])
        seen.append(
            (
                target.snapshot(),
                [
                    [(type(e).__name__, e.group_idx, e.block_hashes) for e in events]
                    for events in taken
                ],
            )
        )
    assert seen[0] == seen[1]
    _, (first, second) = seen[0]
    h = request.block_hashes
    stored, removed = BlockStored.__name__, BlockRemoved.__name__
    assert first == [e for g in (0, 1) for e in [(stored, g, (h[1], h[3])), (stored, g, (h[4],))]]
    assert second == [
        e
        for g in (0, 1)
        for e in [(removed, g, (h[4],)), (stored, g, (h[5],)), (stored, g, (h[4],))]
    ]


@pytest.mark.parametrize("fine", [False, True])
def test_invalid_impl_request_without_a_prompt_length_changes_nothing_where_the_tail_is_keyed(
    fine: bool,
) -> None:
    """Full-attention blocks of two hash blocks: caching reads the prompt's length (its tail),
    fine-grained hits or not, so a request without one is refused before anything changes."""
    impl = KVCacheManager(
        KVCacheConfig(8, (full_attention(4), full_attention(4))),
        16,
        hash_block_size=2,
        fine_grained_hits=fine,
    )
    probe = new_request("r", (1, 2, 2, 1, 1, 2, 1, 2, 2, 2), 2)
    read = ("request_id", "num_tokens", "block_hashes", "num_computed_tokens")
    stranger = SimpleNamespace(
        **{name: getattr(probe, name) for name in read},
        num_preemptions=0,
        all_token_ids=probe.all_token_ids,
    )
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.allocate_slots(stranger, 10)
    assert impl.snapshot() == before
    impl.allocate_slots(probe, 8, delay_cache_blocks=True)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.cache_blocks(stranger, 8)
    assert impl.snapshot() == before


# --------------------------------------------------------------------------
# Gaps found by mutation-testing impl/manager.py (2026-11-29), each compared
# with the model and checked by hand to fail on its mutant
# --------------------------------------------------------------------------


def _model_and_impl(setup: ManagerSetup) -> list[Any]:
    return [ModelManagerTarget(setup), ImplManagerTarget(setup)]


def test_a_hit_of_one_group_reports_no_shared_prefix_boundary() -> None:
    """With one group no other search reaches past the hit: the third value is 0."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2)
    first, probe = new_request("a", (1, 2, 3, 4, 5), 2), new_request("b", (1, 2, 3, 4, 5), 2)
    for target in _model_and_impl(setup):
        target.allocate_slots(first, 5)
        target.free(first)
        assert target.get_computed_blocks_with_boundary(probe) == (((1, 2),), 4, 0)


def test_an_eagle_hybrid_hit_peeks_past_the_candidate_in_model_and_impl() -> None:
    """Full attention drops its sixth block (hit 20 tokens); the window peeks one block
    past that (24 tokens: every hash is cached), finds blocks 4 and 5 and drops 5, so the hit
    stays at 20. Without the drop, the peek, or with the peek cut short, it differs."""
    setup = ManagerSetup(16, (full_attention(4), sliding_window(4, 5)), 32, 4, use_eagle=True)
    first = new_request("a", tuple(range(1, 28)), 4)
    later = new_request("b", tuple(range(1, 26)), 4)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(first, 27) == ((1, 2, 3, 4, 5, 6, 7), tuple(range(8, 15)))
        assert target.get_computed_blocks(later) == (((1, 2, 3, 4, 5), (0, 0, 0, 0, 12)), 20)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_fine_grained_hits_end_inside_a_block(num_groups: int) -> None:
    """Full-attention groups with blocks of two hash blocks and fine-grained hits (the search
    of several groups takes no scheduler-block alignment): the hit ends at the prompt's tail
    keyed by the first request (6 of its 7 tokens), inside the second block, in every group."""
    specs = (full_attention(4),) * num_groups
    setup = ManagerSetup(12, specs, 16, 2, fine_grained_hits=True)
    first = new_request("a", (1, 2, 2, 1, 1, 2, 1), 2)
    probe = new_request("b", (1, 2, 2, 1, 1, 2, 1, 2), 2)
    results = []
    for target in _model_and_impl(setup):
        target.allocate_slots(first, 7)
        target.free(first)
        results.append(target.get_computed_blocks(probe))
    assert results[0] == results[1]
    assert results[0][1] == 6


def test_a_window_beside_a_mamba_align_group_is_searched_again_at_the_states_hit() -> None:
    """Two kinds, neither full attention: the window first finds 12 tokens, the Mamba group
    has a state only at 8, and the window must be searched again at 8 (its two blocks
    before 8), not have its hit at 12 cut back to 8 (a null block, then block 2)."""
    setup = ManagerSetup(24, (sliding_window(4, 8), mamba_align(4)), 64, 4)
    tokens = (0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1)
    first = new_request("a", tokens, 4)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(first, 8) == ((1, 2), (0, 3))
        target.new_step_starts()  # a state cached in a step is hit from the next one on
        assert target.allocate_slots(with_computed(first, 8), 8) == ((4, 5), (0, 6))
        target.new_step_starts()
        target.free(with_computed(first, 16))
        assert target.get_computed_blocks(new_request("b", tokens[:14], 4)) == (
            ((1, 2), (0, 3)),
            8,
        )


def _eagle_hit_after_evictions(
    num_tokens: int, window: int, eagle_groups: tuple[int, ...], evicted: set[int]
) -> list[object]:
    """Full attention and two windows, blocks of two tokens, the window's second twice as
    wide: one request's tokens cached, freed, some blocks evicted, the same tokens looked up
    again, in the model and the impl (EAGLE on the groups flagged, all when none is)."""
    specs = (full_attention(2), sliding_window(2, window), sliding_window(2, window + 3))
    impl = KVCacheManager(
        KVCacheConfig(40, specs, eagle_groups=eagle_groups), 32, hash_block_size=1, use_eagle=True
    )
    model = model_manager.new_kv_cache_manager(
        40, specs, 32, hash_block_size=1, use_eagle=True, eagle_groups=eagle_groups
    )
    first = new_request("a", [1] * num_tokens, 1)
    assert impl.allocate_slots(first, num_tokens) is not None
    model, _ = model_manager.allocate_slots(model, first, num_tokens)
    impl.free(first)
    model, _ = model_manager.free(model, "a")
    impl.evict_blocks(evicted)
    model, _ = model_manager.evict_blocks(model, evicted)
    probe = new_request("b", [1] * num_tokens, 1)
    blocks, num_hit, _ = impl.get_computed_blocks(probe)
    _, expected = model_manager.get_computed_blocks(model, probe)
    return [(tuple(tuple(g) for g in blocks.get_block_ids()), num_hit), expected]


def test_an_eagle_kind_drops_once_per_candidate_length() -> None:
    """EAGLE on every group: a kind that dropped its block at a candidate length is searched
    without dropping in the next round at that length (dropping again would leave the first
    window a null block where the model has block 3)."""
    impl, model = _eagle_hit_after_evictions(4, 1, (), set())
    assert impl == model == (((1,), (3,), (5,)), 2)


def test_an_eagle_kind_drops_again_when_a_kind_without_eagle_cuts_the_hit() -> None:
    """Only the first window is EAGLE's, and its second block (6) is evicted. Once a kind
    that does not drop cuts the candidate, the EAGLE kinds that dropped at the longer one drop
    again at the new length: here that leaves no hit (without it, 2 tokens)."""
    impl, model = _eagle_hit_after_evictions(7, 1, (1,), {6})
    assert impl == model == (((), (), ()), 0)


def test_an_eagle_kind_does_not_drop_again_when_a_kind_without_eagle_agrees() -> None:
    """Only the first window is EAGLE's, full attention's second block (2) is evicted. A
    search without EAGLE that finds the candidate itself is no cut: the kinds that dropped
    at that length stay done (dropping again would leave the first window a null block
    where the model has block 5)."""
    impl, model = _eagle_hit_after_evictions(7, 1, (1,), {2})
    assert impl == model == (((1,), (5,), (9,)), 2)


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize(
    ("first", "probe", "evicted"),
    [
        # the probe leaves the cached tokens after the first block: no tail to extend into
        ((1, 2, 2, 1, 1, 2, 1, 2), (1, 2, 2, 1, 2, 2, 2, 2, 2), ()),
        # the first's tail (10 of 11 tokens) is keyed in its third block, but the second
        # block (2) is evicted: a hit never jumps the hole to reach that tail
        ((1, 2, 2, 1, 1, 2, 1, 2, 2, 1, 1), (1, 2, 2, 1, 1, 2, 1, 2, 2, 1, 1), (2,)),
        # the first's tail ends at 6 tokens, past what the probe may hit (5 of its 6)
        ((1, 2, 2, 1, 1, 2, 1), (1, 2, 2, 1, 1, 2), ()),
    ],
)
def test_a_fine_grained_hit_without_a_tail_in_reach_ends_on_its_last_block(
    num_groups: int, first: tuple[int, ...], probe: tuple[int, ...], evicted: tuple[int, ...]
) -> None:
    setup = ManagerSetup(12, (full_attention(4),) * num_groups, 16, 2, fine_grained_hits=True)
    # each group's first block: group 1's blocks follow all of group 0's
    expected = (((1,), (-(-len(first) // 4) + 1,))[:num_groups], 4)
    for target in _model_and_impl(setup):
        request = new_request("a", first, 2)
        target.allocate_slots(request, len(first))
        target.free(request)
        target.evict_blocks(evicted)
        assert target.get_computed_blocks(new_request("b", probe, 2)) == expected


def test_a_fine_grained_hit_takes_the_highest_cached_boundary_below_a_missing_one() -> None:
    """Blocks of four hash blocks: the first request's tail is keyed at 4 tokens, the probe
    differs from 4 on, so the search steps down one hash block at a time past 6 to 4."""
    setup = ManagerSetup(12, (full_attention(8),), 16, 2, fine_grained_hits=True)
    for target in _model_and_impl(setup):
        request = new_request("a", (1, 2, 2, 1, 1), 2)
        target.allocate_slots(request, 5)
        target.free(request)
        probe = new_request("b", (1, 2, 2, 1, 2, 2, 2, 2), 2)
        assert target.get_computed_blocks(probe) == (((1,),), 4)


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": "r", "num_tokens": 5},  # no block hashes
        {"request_id": "r", "num_tokens": "5", "block_hashes": []},
        {"request_id": "r", "num_tokens": 5, "block_hashes": None},
    ],
)
def test_invalid_request_to_look_up_changes_nothing(fields: dict[str, object]) -> None:
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    impl.allocate_slots(new_request("a", (1, 2, 3, 4, 5), 2), 5)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.get_computed_blocks(SimpleNamespace(**fields))
    assert impl.snapshot() == before


def test_a_subclass_search_that_reports_nothing_past_its_hit_gives_no_boundary() -> None:
    """A subclass may override find_longest_cache_hit (the bug corpora do) and leave no
    tokens past its hit: the lookup's shared-prefix boundary is then 0, whatever an earlier
    lookup's search reached (here the window's block 9 evicted: full attention reached 8
    tokens, the hit stopped at 6)."""

    class SecondLookupMisses(KVCacheManager):
        searched = False

        def find_longest_cache_hit(self, block_hashes: Any, max_length: int) -> Any:
            if self.searched:
                return tuple([] for _ in self.managers), 0
            self.searched = True
            return super().find_longest_cache_hit(block_hashes, max_length)

    impl = SecondLookupMisses(KVCacheConfig(16, (full_attention(2), sliding_window(2, 2))), 16)
    first = new_request("a", tuple(range(1, 10)), 2)
    assert impl.allocate_slots(first, 9) is not None
    impl.free(first)
    impl.evict_blocks([9])
    probe = new_request("b", tuple(range(1, 10)), 2)
    assert impl.get_computed_blocks(probe)[1:] == (6, 8)
    assert impl.get_computed_blocks(probe)[1:] == (0, 0)


@pytest.mark.parametrize(("num_blocks", "fits"), [(3, False), (4, True)])
def test_a_hit_ending_inside_a_block_needs_a_free_block_for_its_copy(
    num_blocks: int, fits: bool
) -> None:
    """The hit of 6 tokens ends inside its second block (fine-grained hits): allocating
    takes both hit blocks from the free queue and one more for the private copy, so two free
    blocks are not enough and three are."""
    setup = ManagerSetup(num_blocks, (full_attention(4),), 16, 2, fine_grained_hits=True)
    tokens = (1, 2, 2, 1, 1, 2, 1)
    states = []
    for target in _model_and_impl(setup):
        first = new_request("a", tokens, 2)
        target.allocate_slots(first, 7)
        target.free(first)
        probe = new_request("b", (*tokens, 2), 2)
        hit, num_hit = target.get_computed_blocks(probe)
        assert (hit, num_hit) == (((1, 2),), 6)
        allocated = target.allocate_slots(probe, 2, num_hit, hit)
        assert (allocated is not None) is fits
        states.append(target.snapshot())
    assert states[0] == states[1]


@pytest.mark.parametrize(
    "blocks", [[[]], ([], None)], ids=["a-list-of-groups", "a-group-not-a-list"]
)
def test_invalid_hits_not_a_tuple_of_lists_change_nothing(blocks: Any) -> None:
    """Hits in vLLM's KVCacheBlocks (taken by class name), whose constructor takes anything:
    kvpool's own class refuses these at construction in the compiled build."""

    class KVCacheBlocks:  # stands in for vllm.v1.core.kv_cache_manager.KVCacheBlocks
        def __init__(self, blocks: Any) -> None:
            self.blocks = blocks

    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2), full_attention(2))), 16)
    request = new_request("a", (1, 2, 3, 4, 5), 2)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument, match="tuple of lists"):
        impl.allocate_slots(request, 5, 0, KVCacheBlocks(blocks))
    assert impl.snapshot() == before


def test_a_hit_beside_a_mamba_group_with_hits_inside_its_blocks_is_the_models() -> None:
    """Full attention of one hash block beside Mamba "align" blocks of three
    (kvpool.impl.mamba_fine): the hybrid search takes the Mamba group's hit from its own
    search, which ends where the state was kept (12 tokens)."""
    setup = ManagerSetup(32, (full_attention(4), mamba_align(12)), 64, 4)
    tokens = tuple(range(16))
    answers = []
    for target in _model_and_impl(setup):
        first = new_request("a", tokens, 4)
        target.allocate_slots(first, 12)
        target.new_step_starts()  # a state cached in a step is hit from the next one on
        target.free(with_computed(first, 12))
        answers.append(target.get_computed_blocks(new_request("b", tokens, 4)))
    assert answers[0] == answers[1]
    assert answers[0][1] == 12


def test_external_tokens_and_the_step_s_own_get_blocks_in_model_and_impl() -> None:
    """A connector loads 12 tokens and the step computes 2: blocks for all 14, the step's
    own (block 4) returned after the three the load fills."""
    setup = ManagerSetup(16, (full_attention(4),), 64, 4)
    request = new_request("r", tuple(range(14)), 4)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 2, num_external_computed_tokens=12) == ((4,),)
        assert target.snapshot().managers.tables[0].req_to_blocks["r"] == (1, 2, 3, 4)
        # no Mamba group: nothing to zero; the loaded blocks are cached with the step's
        assert list(target.take_new_block_ids()) == []
        assert target.get_computed_blocks(new_request("o", tuple(range(14)), 4))[1] == 12


@pytest.mark.parametrize(
    ("caching", "delay"), [(False, False), (True, True)], ids=["no-caching", "delayed"]
)
def test_hashes_are_read_only_by_the_step_that_caches(caching: bool, delay: bool) -> None:
    """Without caching, or with caching delayed to cache_blocks, allocating never reads the
    hashes: a request whose hashes are not bytes gets its blocks, as in the model."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2, enable_caching=caching)
    request = replace(new_request("a", (1, 2, 3, 4, 5), 2), block_hashes=cast(Any, (1, 2)))
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 5, delay_cache_blocks=delay) == ((1, 2, 3),)


@pytest.mark.parametrize("value", [5, 0.0])
def test_invalid_encoder_tokens_change_nothing(value: object) -> None:
    """kvpool models only vLLM's default of 0 (an int) encoder tokens."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument, match="num_encoder_tokens"):
        impl.allocate_slots(new_request("a", (1, 2, 3), 2), 3, num_encoder_tokens=value)
    assert impl.snapshot() == before


def test_an_async_load_takes_no_new_tokens_in_model_and_impl() -> None:
    """While a connector loads 12 tokens, the step asks for none: blocks for the load only."""
    setup = ManagerSetup(16, (full_attention(4),), 64, 4)
    request = new_request("r", tuple(range(14)), 4)
    for target in _model_and_impl(setup):
        allocated = target.allocate_slots(
            request, 0, num_external_computed_tokens=12, delay_cache_blocks=True
        )
        assert allocated == ((),)
        assert target.snapshot().managers.tables[0].req_to_blocks["r"] == (1, 2, 3)
        # caching delayed: nothing is cached until the load is done
        assert target.get_computed_blocks(new_request("o", tuple(range(14)), 4))[1] == 0


@pytest.mark.parametrize(("num_blocks", "fits"), [(4, True), (3, False)])
def test_a_full_sequence_that_must_fit_is_admitted_exactly_when_it_fits(
    num_blocks: int, fits: bool
) -> None:
    """A prompt of 5 tokens, blocks of 2, max_model_len 6: the whole sequence needs three
    blocks; a pool with three free admits it, one with two refuses it."""
    setup = ManagerSetup(num_blocks, (full_attention(2),), 6, 2)
    for target in _model_and_impl(setup):
        allocated = target.allocate_slots(
            new_request("a", (1, 2, 3, 4, 5), 2), 2, full_sequence_must_fit=True
        )
        assert (allocated is not None) is fits


def test_one_external_token_gets_a_block_of_its_own() -> None:
    """Blocks of one token: the loaded token's block is not among the step's new blocks."""
    setup = ManagerSetup(8, (full_attention(1),), 16, 1)
    for target in _model_and_impl(setup):
        request = new_request("r", (1, 2, 3), 1)
        assert target.allocate_slots(request, 1, num_external_computed_tokens=1) == ((2,),)


@pytest.mark.parametrize(("reserved", "fits"), [(2, True), (3, False)])
def test_external_tokens_and_reserved_blocks_must_leave_the_pool_enough(
    reserved: int, fits: bool
) -> None:
    """Five free blocks; loading 8 tokens and computing 4 takes three: they fit beside a
    reservation of two blocks, not of three."""
    setup = ManagerSetup(6, (full_attention(4),), 64, 4)
    request = new_request("r", tuple(range(14)), 4)
    for target in _model_and_impl(setup):
        allocated = target.allocate_slots(
            request, 4, num_external_computed_tokens=8, reserved_blocks=reserved
        )
        assert (allocated is not None) is fits


def test_external_tokens_beyond_the_free_blocks_are_refused() -> None:
    """Three free blocks; loading 8 tokens and computing 6 takes four: refused."""
    setup = ManagerSetup(4, (full_attention(4),), 64, 4)
    request = new_request("r", tuple(range(15)), 4)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 6, num_external_computed_tokens=8) is None
        assert target.snapshot().managers.tables[0].req_to_blocks == {}


def test_hits_in_vllms_kv_cache_blocks_class_are_taken() -> None:
    """A connector's caller may wrap the pool's blocks in vLLM's KVCacheBlocks (read by class
    name): the hit is taken as from kvpool's own class."""

    class KVCacheBlocks:  # stands in for vllm.v1.core.kv_cache_manager.KVCacheBlocks
        def __init__(self, blocks: Any) -> None:
            self.blocks = blocks

    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    first = new_request("a", (1, 2, 3, 4, 5), 2)
    impl.allocate_slots(first, 5)
    impl.free(first)
    probe = new_request("b", (1, 2, 3, 4, 5), 2)
    hit, num_hit, _ = impl.get_computed_blocks(probe)
    allocated = impl.allocate_slots(probe, 1, num_hit, KVCacheBlocks(hit.blocks))
    assert allocated is not None
    assert impl.get_block_ids("b") == ([1, 2, 3],)


def test_an_async_load_of_one_token_takes_no_new_tokens() -> None:
    setup = ManagerSetup(8, (full_attention(1),), 16, 1)
    for target in _model_and_impl(setup):
        request = new_request("r", (1, 2, 3), 1)
        allocated = target.allocate_slots(
            request, 0, num_external_computed_tokens=1, delay_cache_blocks=True
        )
        assert allocated == ((),)


def test_invalid_external_token_after_a_hit_ending_inside_a_block_changes_nothing() -> None:
    """Not modelled: refused by name, in model and impl alike, even for one token."""
    setup = ManagerSetup(8, (full_attention(4),), 16, 2, fine_grained_hits=True)
    tokens = (1, 2, 2, 1, 1, 2, 1)
    for target in _model_and_impl(setup):
        first = new_request("a", tokens, 2)
        target.allocate_slots(first, 7)
        target.free(first)
        probe = new_request("b", (*tokens, 2, 2), 2)
        hit, num_hit = target.get_computed_blocks(probe)
        assert num_hit == 6
        before = target.snapshot()
        with pytest.raises(InvalidArgument, match="inside a block"):
            target.allocate_slots(probe, 2, num_hit, hit, num_external_computed_tokens=1)
        assert target.snapshot() == before


def test_a_hit_inside_a_mamba_block_is_copied_in_model_and_impl() -> None:
    """A consumer resuming inside a Mamba "align" block (kvpool.impl.mamba_fine) gets one
    pending copy of that state to a private block, the same in model and impl."""
    setup = ManagerSetup(32, (full_attention(4), mamba_align(12)), 64, 4)
    prompt = tuple(range(22))
    answers = []
    for target in _model_and_impl(setup):
        producer = new_request("a", prompt, 4)
        target.allocate_slots(producer, 20)  # stops at its prompt's partial boundary
        target.new_step_starts()
        target.allocate_slots(with_computed(producer, 20), 2)
        _, retained = target.take_kv_cache_block_copies()
        target.free_blocks(list(retained))
        target.new_step_starts()
        target.free(with_computed(producer, 22))
        consumer = new_request("b", (*prompt[:21], 99, 98), 4)
        hit, num_hit = target.get_computed_blocks(consumer)
        target.take_new_block_ids()
        allocated = target.allocate_slots(consumer, 3, num_hit, hit)
        copies = target.take_kv_cache_block_copies()
        answers.append((num_hit, allocated, copies, target.take_new_block_ids()))
    assert answers[0] == answers[1]
    num_hit, allocated, (copies, _), zeroed = answers[0]
    assert num_hit == 20 and len(copies) == 1
    # both groups' new blocks returned; the attention group's recorded for zeroing
    assert allocated is not None and len(allocated) == 2 and list(zeroed) == list(allocated[0])


def test_a_hit_ending_inside_its_only_block_is_copied() -> None:
    """Fine-grained hits: the first request's tail is keyed at 2 tokens, inside its first
    block; a probe's hit of that one block is copied to a private block, in model and impl."""
    setup = ManagerSetup(8, (full_attention(4),), 16, 2, fine_grained_hits=True)
    answers = []
    for target in _model_and_impl(setup):
        first = new_request("a", (1, 2, 1), 2)
        target.allocate_slots(first, 3)
        target.free(first)
        probe = new_request("b", (1, 2, 1, 1, 2), 2)
        hit, num_hit = target.get_computed_blocks(probe)
        assert (hit, num_hit) == (((1,),), 2)
        allocated = target.allocate_slots(probe, 3, num_hit, hit)
        answers.append((allocated, target.take_kv_cache_block_copies(), target.snapshot()))
    assert answers[0] == answers[1]
    assert tuple(answers[0][1][0]) == ((1, 2),)


def test_invalid_hash_of_a_block_the_step_fills_changes_nothing() -> None:
    """The hashes the caching step will read are checked before anything changes."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    request = new_request("a", (1, 2, 3, 4, 5), 2)
    bad = replace(request, block_hashes=cast(Any, (request.block_hashes[0], 2)))
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.allocate_slots(bad, 5)
    assert impl.snapshot() == before


def test_a_running_request_s_full_sequence_counts_the_blocks_it_holds() -> None:
    """Three usable blocks, the sequence needs three: the request holds one after its first
    step, so the two free ones are enough for the rest of the whole sequence."""
    setup = ManagerSetup(4, (full_attention(2),), 6, 2)
    request = new_request("a", (1, 2, 3, 4, 5), 2)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 2) == ((1,),)
        running = with_computed(request, 2)
        assert target.allocate_slots(running, 2, full_sequence_must_fit=True) == ((2,),)


@pytest.mark.parametrize(
    ("specs", "num_blocks", "must_fit", "expected"),
    [
        # three free blocks, counted for the step as a connector's load is counted
        ((full_attention(1), sliding_window(1, 1)), 4, False, ((2,), (3,))),
        # four free blocks, counted for the whole sequence as a connector's load is counted
        ((sliding_window(1, 1),), 5, True, ((1,),)),
    ],
    ids=["counted", "full-sequence"],
)
def test_a_window_counts_no_block_for_one_loaded_token_it_skips(
    specs: tuple[KVCacheSpec, ...],
    num_blocks: int,
    must_fit: bool,
    expected: tuple[tuple[int, ...], ...],
) -> None:
    """Blocks of one token, a window of one: one token loaded by a connector is already
    outside the window when the step computes the next, so its block is a null block and
    is not counted (kvpool.impl.external), in model and impl alike."""
    setup = ManagerSetup(num_blocks, specs, 8, 1)
    for target in _model_and_impl(setup):
        request = new_request("r", (1, 2, 3, 4, 5), 1)
        allocated = target.allocate_slots(
            request, 1, num_external_computed_tokens=1, full_sequence_must_fit=must_fit
        )
        assert allocated == expected


def _allocation_refused(impl: KVCacheManager, request: Any, *args: Any, **kwargs: Any) -> None:
    before = impl.snapshot()
    with pytest.raises((InvalidArgument, InvalidTokenCount, UnknownGroup)):
        impl.allocate_slots(request, *args, **kwargs)
    assert impl.snapshot() == before


def test_invalid_request_to_allocate_for_changes_nothing() -> None:
    """A request without the computed tokens, preemptions or token ids allocating reads."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    probe = new_request("r", (1, 2, 3, 4, 5), 2)
    read = ("request_id", "num_tokens", "block_hashes")
    _allocation_refused(impl, SimpleNamespace(**{n: getattr(probe, n) for n in read}), 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_new_tokens": "5"},
        {"num_new_tokens": 5, "num_lookahead_tokens": 1.0},
        {"num_new_tokens": 5, "reserved_blocks": -1},
        {"num_new_tokens": 5, "skip_zeroing_group_ids": (3,)},
    ],
)
def test_invalid_allocation_arguments_change_nothing(kwargs: dict[str, Any]) -> None:
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    _allocation_refused(impl, new_request("r", (1, 2, 3, 4, 5), 2), **kwargs)


def test_invalid_shared_prefix_boundary_under_sparse_retention_changes_nothing() -> None:
    """A sparse-retention manager reads the request's shared-prefix boundary: not an int, it
    is refused by name before anything changes."""
    config = KVCacheConfig(
        8, (full_attention(2), sliding_window(2, 2)), prefix_cache_retention_interval=2
    )
    impl = KVCacheManager(config, 16)
    request = replace(new_request("r", (1, 2, 3, 4, 5), 2), shared_prefix_boundary=cast(Any, "0"))
    _allocation_refused(impl, request, 5)


@pytest.mark.parametrize(
    ("num_blocks", "first_runs", "fits"),
    [(4, False, False), (5, False, True), (5, True, True)],
    ids=["free-hits-too-many", "free-hits-fit", "running-hits"],
)
def test_a_full_sequence_that_must_fit_counts_its_free_hits(
    num_blocks: int, first_runs: bool, fits: bool
) -> None:
    """The probe hits the first request's two blocks; its whole sequence (7 tokens) needs
    two more. With the first freed its hits come off the free queue too (four blocks; the
    step alone would take three), with the first still running they are already held."""
    setup = ManagerSetup(num_blocks, (full_attention(2),), 8, 2)
    for target in _model_and_impl(setup):
        first = new_request("a", (1, 2, 3, 4), 2)
        assert target.allocate_slots(first, 4) is not None
        if not first_runs:
            target.free(first)
        probe = new_request("b", (1, 2, 3, 4, 5, 6, 7), 2)
        hit, num_hit = target.get_computed_blocks(probe)
        assert num_hit == 4
        allocated = target.allocate_slots(probe, 1, num_hit, hit, full_sequence_must_fit=True)
        assert (allocated is not None) is fits


@pytest.mark.parametrize("inside", [([None],), ([1, "x"], []), (None,)])
def test_kvcacheblocks_repr_never_raises(inside: Any) -> None:
    """A test framework prints a failing call's arguments, junk ones included."""
    text = repr(KVCacheBlocks(inside))
    assert text.startswith("KVCacheBlocks(")


def test_kvcacheblocks_repr_shows_block_ids() -> None:
    pool = BlockPool(4, True, 1)
    blocks = pool.get_new_blocks(2)
    assert repr(KVCacheBlocks((blocks, []))) == "KVCacheBlocks(([1, 2], []))"


# --------------------------------------------------------------------------
# Survivors of the re-run of 2026-11-29 (session 9) over the same operations,
# each compared with the model and checked by hand to fail on its mutant
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "fits"), [(20, True), (21, False)])
def test_external_tokens_of_a_full_sequence_that_must_fit_count_its_every_block(
    num_tokens: int, fits: bool
) -> None:
    """Five free blocks of 4 tokens; a connector loads 8 and the step computes 4 (three
    blocks, which fit), but the whole sequence must fit: 20 tokens take five blocks and are
    admitted, 21 take six and are refused, with nothing allocated."""
    setup = ManagerSetup(6, (full_attention(4),), 64, 4)
    request = new_request("r", tuple(range(num_tokens)), 4)
    for target in _model_and_impl(setup):
        allocated = target.allocate_slots(
            request, 4, num_external_computed_tokens=8, full_sequence_must_fit=True
        )
        assert (allocated is not None) is fits
        if not fits:
            assert target.snapshot().managers.tables[0].req_to_blocks == {}


@pytest.mark.parametrize(("extra", "fits"), [(21, True), (22, False)])
def test_a_full_sequence_that_must_fit_counts_the_copy_of_a_hit_ending_inside_a_block(
    extra: int, fits: bool
) -> None:
    """Fine-grained hits: the probe hits 2 tokens inside the first request's freed block (a
    free hit, plus a fresh block for its copy). Seven usable blocks of 4 tokens: a sequence
    of 24 tokens needs 5 more blocks beside the hit, 7 in all, and fits; 25 need 8."""
    setup = ManagerSetup(8, (full_attention(4),), 64, 2, fine_grained_hits=True)
    for target in _model_and_impl(setup):
        first = new_request("a", (1, 2, 1), 2)
        target.allocate_slots(first, 3)
        target.free(first)
        probe = new_request("b", (1, 2, 1, *range(10, 10 + extra)), 2)
        hit, num_hit = target.get_computed_blocks(probe)
        assert (hit, num_hit) == (((1,),), 2)
        allocated = target.allocate_slots(probe, 3, num_hit, hit, full_sequence_must_fit=True)
        assert (allocated is not None) is fits


@pytest.mark.parametrize(
    ("mamba_spec", "num_hit", "extra", "fits"),
    [
        (mamba_align(12), 20, 27, True),
        (mamba_align(12), 20, 28, False),
        (mamba_reserving(12, 0, 4), 0, 31, True),
        (mamba_reserving(12, 0, 4), 0, 32, False),
    ],
    ids=["align-fits", "align-refused", "checkpoints-fit", "checkpoints-refused"],
)
def test_a_mamba_groups_whole_sequence_is_counted_in_model_and_impl(
    mamba_spec: KVCacheSpec, num_hit: int, extra: int, fits: bool
) -> None:
    """A Mamba "align" group of 12-token blocks beside attention blocks of 4, 16 blocks in
    the pool: a consumer whose whole sequence must fit is admitted up to a length and
    refused one token past it, in model and impl alike. Plain "align": its hit of 20
    tokens ends inside a state block, whose copy is counted too. With prefill checkpoints
    (kvpool.impl.mamba_fine_reserve) there is no hit, and the group's checkpoint blocks
    are counted."""
    setup = ManagerSetup(16, (full_attention(4), mamba_spec), 128, 4)
    prompt = tuple(range(22))
    for target in _model_and_impl(setup):
        producer = new_request("a", prompt, 4)
        assert target.allocate_slots(producer, 20) is not None
        target.new_step_starts()
        assert target.allocate_slots(with_computed(producer, 20), 2) is not None
        _, retained = target.take_kv_cache_block_copies()
        target.free_blocks(list(retained))
        target.new_step_starts()
        target.free(with_computed(producer, 22))
        consumer = new_request("b", (*prompt[:21], *range(100, 100 + extra)), 4)
        hit, hit_tokens = target.get_computed_blocks(consumer)
        assert hit_tokens == num_hit
        allocated = target.allocate_slots(consumer, 3, hit_tokens, hit, full_sequence_must_fit=True)
        assert (allocated is not None) is fits


def test_a_full_sequence_already_held_fits_in_a_pool_with_no_free_block() -> None:
    """Three usable blocks of 2 tokens; the request's first step takes all three for 5 of
    its 6 tokens. Its last token needs no block, and its whole sequence lacks none: it is
    admitted with the free queue empty, in model and impl alike."""
    setup = ManagerSetup(4, (full_attention(2),), 16, 2)
    request = new_request("a", (1, 2, 3, 4, 5, 6), 2)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 5) == ((1, 2, 3),)
        running = with_computed(request, 5)
        assert target.allocate_slots(running, 1, full_sequence_must_fit=True) == ((),)


def test_invalid_block_range_of_the_group_of_smaller_blocks_changes_nothing() -> None:
    """Blocks of 4 and of 2 tokens, hashed in 2: after 6 tokens the first group holds 8
    tokens' blocks, the second 6. Caching 8 tokens fits the first group and not the second:
    refused before the first caches anything, in model and impl alike."""
    setup = ManagerSetup(16, (full_attention(4), full_attention(2)), 64, 2)
    request = new_request("a", tuple(range(12)), 2)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 6) == ((1, 2), (3, 4, 5))
        before = target.snapshot()
        with pytest.raises(InvalidBlockRange):
            target.cache_blocks(with_computed(request, 6), 8)
        assert target.snapshot() == before


def test_invalid_caching_for_a_request_holding_nothing_changes_nothing() -> None:
    """cache_blocks for a request no group knows: the model's UnknownRequest, by name, with
    the state unchanged (another request holds blocks, some of them cached)."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(new_request("a", (1, 2, 3, 4, 5), 2), 5) is not None
        before = target.snapshot()
        with pytest.raises(UnknownRequest):
            target.cache_blocks(new_request("b", (1, 2, 3, 4, 5), 2), 4)
        assert target.snapshot() == before


def test_invalid_hash_is_refused_only_when_a_step_fills_its_block() -> None:
    """A request whose second hash is not bytes: its first step (one block) never reads it
    and is allocated; its second, which fills the block after the one it has cached,
    is refused before anything changes, in model and impl alike."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2)
    request = new_request("a", (1, 2, 3, 4, 5), 2)
    bad = replace(request, block_hashes=cast(Any, (request.block_hashes[0], 2)))
    for target in _model_and_impl(setup):
        assert target.allocate_slots(bad, 2) == ((1,),)
        before = target.snapshot()
        with pytest.raises(InvalidArgument):
            target.allocate_slots(with_computed(bad, 2), 2)
        assert target.snapshot() == before


def test_the_hash_of_a_block_already_cached_is_not_read_again() -> None:
    """The request's first step cached its first block; its next step fills the second.
    Passed with its first hash no longer bytes, the step reads only the second: allocated,
    the second block cached, in model and impl alike."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2)
    request = new_request("a", (1, 2, 3, 4, 5), 2)
    answers = []
    for target in _model_and_impl(setup):
        assert target.allocate_slots(request, 2) == ((1,),)
        running = with_computed(request, 2)
        bad = replace(running, block_hashes=cast(Any, (2, request.block_hashes[1])))
        answers.append((target.allocate_slots(bad, 2), target.snapshot()))
    assert answers[0] == answers[1]
    assert answers[0][0] == ((2,),)
    assert answers[0][1].managers.tables[0].num_cached_block == {"a": 2}


def _caching_refused(impl: KVCacheManager, request: Any, num_computed_tokens: Any) -> None:
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.cache_blocks(request, num_computed_tokens)
    assert impl.snapshot() == before


@pytest.mark.parametrize("count", ["4", 4.0, True])
def test_invalid_caching_arguments_change_nothing(count: Any) -> None:
    """cache_blocks of a request holding blocks whose caching was delayed: a request
    missing the fields a request has, or a count that is not an int (a bool is not one),
    is refused by name before anything is cached."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    request = new_request("r", (1, 2, 3, 4, 5), 2)
    impl.allocate_slots(request, 5, delay_cache_blocks=True)
    read = ("request_id", "num_tokens", "block_hashes", "all_token_ids")
    _caching_refused(impl, SimpleNamespace(**{n: getattr(request, n) for n in read}), 4)
    _caching_refused(impl, request, count)


def test_invalid_shared_prefix_boundary_changes_nothing_when_caching() -> None:
    """Under sparse retention cache_blocks reads the request's shared-prefix boundary: not an
    int, it is refused by name before anything is cached."""
    config = KVCacheConfig(
        8, (full_attention(2), sliding_window(2, 2)), prefix_cache_retention_interval=2
    )
    impl = KVCacheManager(config, 16)
    request = new_request("r", (1, 2, 3, 4, 5), 2)
    impl.allocate_slots(request, 5, delay_cache_blocks=True)
    bad = replace(request, shared_prefix_boundary=cast(Any, "0"))
    _caching_refused(impl, bad, 4)


@pytest.mark.parametrize("request_id", [None, 3])
def test_invalid_request_id_to_free_changes_nothing(request_id: object) -> None:
    """free of a request without an id, or with an id that is not a str: refused by name
    (a request holds blocks, so a silent no-op would be a different answer)."""
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    impl.allocate_slots(new_request("r", (1, 2, 3, 4, 5), 2), 5)
    stranger = SimpleNamespace() if request_id is None else SimpleNamespace(request_id=request_id)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.free(stranger)
    assert impl.snapshot() == before


def test_invalid_hash_to_cache_changes_nothing() -> None:
    """cache_blocks of a request whose caching was delayed, with its first hash no longer
    bytes, in blocks of 4 and of 2 tokens hashed in 2: the first group's block is keyed
    by the second hash alone, the second group reads both. Refused by name before the
    first group caches anything."""
    impl = KVCacheManager(
        KVCacheConfig(8, (full_attention(4), full_attention(2))), 16, hash_block_size=2
    )
    request = new_request("r", (1, 2, 3, 4, 5), 2)
    impl.allocate_slots(request, 5, delay_cache_blocks=True)
    bad = replace(request, block_hashes=cast(Any, (2, request.block_hashes[1])))
    _caching_refused(impl, bad, 4)


@pytest.mark.parametrize(
    ("num_tokens", "error"),
    [(-2, InvalidTokenCount), (3, InvalidTokenCount), (6, InvalidHit)],
    ids=["negative", "inside-a-block", "past-the-hit"],
)
def test_invalid_truncation_is_refused_as_the_model_refuses_it(
    num_tokens: int, error: type[Exception]
) -> None:
    """A hit of two 2-token blocks cut to a negative count, to a count inside a block, or
    past the hit: the model's error, in model and impl alike."""
    setup = ManagerSetup(8, (full_attention(2),), 16, 2)
    first = new_request("a", (1, 2, 3, 4, 5), 2)
    for target in _model_and_impl(setup):
        target.allocate_slots(first, 5)
        target.free(first)
        hit, num_hit = target.get_computed_blocks(new_request("b", (1, 2, 3, 4, 5), 2))
        assert num_hit == 4
        with pytest.raises(error):
            target.truncate_computed_blocks(hit, num_tokens)


@pytest.mark.parametrize("num_tokens", ["2", 2.0])
def test_invalid_truncation_count_not_an_int(num_tokens: object) -> None:
    impl = KVCacheManager(KVCacheConfig(8, (full_attention(2),)), 16)
    with pytest.raises(InvalidArgument):
        impl.truncate_computed_blocks(impl.empty_kv_cache_blocks, num_tokens)


def test_blocks_to_zero_of_several_allocations_come_group_by_group() -> None:
    """Two attention groups beside a Mamba group, two requests allocated before the blocks
    to zero are taken: group 0's blocks of both requests, then group 1's, in model and impl
    alike."""
    setup = ManagerSetup(16, (full_attention(4), sliding_window(4, 8), mamba(32)), 32, 4)
    for target in _model_and_impl(setup):
        assert target.allocate_slots(new_request("a", tuple(range(5)), 4), 5) == (
            (1, 2),
            (3, 4),
            (5,),
        )
        target.allocate_slots(new_request("b", tuple(range(10, 15)), 4), 5)
        assert list(target.take_new_block_ids()) == [1, 2, 6, 7, 3, 4, 8, 9]


@pytest.mark.parametrize("num_prompt_tokens", ["5", 5.0])
def test_invalid_prompt_length_to_remove_skipped_blocks_changes_nothing(
    num_prompt_tokens: object,
) -> None:
    """num_prompt_tokens is read by none of kvpool's groups, but one that is not an int is
    refused by name like every count, before any group frees a block."""
    impl = KVCacheManager(KVCacheConfig(8, (sliding_window(2, 2),)), 16)
    impl.allocate_slots(new_request("r", (1, 2, 3, 4, 5, 6), 2), 6)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.remove_skipped_blocks("r", 6, num_prompt_tokens)
    assert impl.snapshot() == before
