"""The impl's KVCacheManager against the model where the lock-step machine does not reach.

The machine always builds managers from valid configurations and passes
every argument explicitly; these tests pin down the rest: which
configurations are refused (with the model's exception type), what the
defaults are, and how block lists combine.
"""

import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.impl import BlockPool
from kvpool.impl.manager import KVCacheBlocks, KVCacheConfig, KVCacheManager
from kvpool.impl.single_type import get_manager_for_kv_cache_spec
from kvpool.model import manager as model_manager
from kvpool.model import pool as pool_ops
from kvpool.model import single_type as single
from kvpool.model.errors import InvalidArgument
from kvpool.model.pool import new_pool
from kvpool.model.request import new_request
from kvpool.model.single_type import (
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)
from kvpool.specs.request.machine import layout_specs
from kvpool.specs.request.target import HYBRID_LAYOUTS

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
