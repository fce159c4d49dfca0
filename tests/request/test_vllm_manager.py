"""kvpool's manager model against vLLM's own KVCacheManager (vLLM 0.33 API).

vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1``.
"""

import importlib
from typing import Any, cast

import pytest

from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import chunked_local, full_attention, sliding_window
from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup, ManagerTargetSpec

pytestmark = pytest.mark.usefixtures("require_vllm_manager")


def test_vllm_manager_conforms_at_level_1() -> None:
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    report = run_manager_conformance(VLLM_SCOPE, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


def test_vllm_hybrid_managers_conform_at_level_1() -> None:
    """Two or three groups through vLLM's hybrid coordinator: two groups of one spec, the
    window listed first, two windows that shorten each other's hit, chunked local beside
    full attention; full attention beside Mamba (caching off: its blocks are zeroed); groups
    of two block sizes."""
    from dataclasses import replace

    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    hybrids = tuple(layout for layout in VLLM_SCOPE.layouts if "+" in layout)
    assert len(hybrids) == 8
    scope = replace(VLLM_SCOPE, layouts=hybrids)
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"


@pytest.mark.parametrize(
    ("layouts", "context_parallel"),
    [
        (("wide_full+sliding_window", "full+wide_sliding_window"), ((1, 1),)),
        (("full", "full+full"), ((2, 1), (1, 2), (2, 2))),
    ],
    ids=["two-block-sizes", "context-parallel"],
)
def test_vllm_block_geometry_conforms_at_level_1(
    layouts: tuple[str, ...], context_parallel: tuple[tuple[int, int], ...]
) -> None:
    """Hits at multiples of the scheduler block size, sliding-window blocks cached only
    where a hit can end, and sharded blocks of decode context parallelism (vLLM 0.33's
    HybridKVCacheCoordinator and SingleTypeKVCacheManager; docs/semantics.md)."""
    from dataclasses import replace

    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    scope = replace(VLLM_SCOPE, layouts=layouts, context_parallel=context_parallel)
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"


def both(setup: ManagerSetup) -> tuple[object, object]:
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    return ModelManagerTarget(setup), VllmManagerTarget(setup)


def test_the_model_releases_the_last_cached_block_of_an_old_chunk_as_vllm_033_does() -> None:
    """0.10.1.1 kept a chunked-local request's last cached block (seed 002); 0.33 releases it,
    and so does the model: with two blocks, the second allocation succeeds on both."""
    setup = ManagerSetup(2, (chunked_local(1, 1),), 16, 1)
    request = new_request("r", (1, 2, 2, 1), 1)
    answers = []
    for target in both(setup):
        assert target.allocate_slots(request, 1) == ((1,),)  # type: ignore[attr-defined]
        answers.append(target.allocate_slots(with_computed(request, 1), 1))  # type: ignore[attr-defined]
    assert answers == [((1,),), ((1,),)]


def test_vllm_033_caches_no_sliding_window_block_for_a_window_of_one() -> None:
    """A window of one token needs no block for a hit: 0.33 caches none, the model all."""
    setup = ManagerSetup(8, (sliding_window(1, 1),), 16, 1)
    request = new_request("a", (1, 2, 2, 1), 1)
    later = new_request("b", (1, 2, 2, 1, 1), 1)
    hits = []
    for target in both(setup):
        target.allocate_slots(request, 4)  # type: ignore[attr-defined]
        hits.append(target.get_computed_blocks(later))  # type: ignore[attr-defined]
    assert hits == [(((0, 0, 0, 4),), 4), (((),), 0)]


def test_vllm_033_eagle_hybrid_search_peeks_past_the_candidate_as_the_model_does() -> None:
    """Full attention drops its sixth block; the window peeks one block past the 20 tokens
    left and drops back (HybridKVCacheCoordinator.find_longest_cache_hit in 0.33.0)."""
    setup = ManagerSetup(16, (full_attention(4), sliding_window(4, 5)), 32, 4, use_eagle=True)
    first = new_request("a", tuple(range(1, 28)), 4)
    later = new_request("b", tuple(range(1, 26)), 4)
    hits = []
    for target in both(setup):
        target.allocate_slots(first, 27)  # type: ignore[attr-defined]
        hits.append(target.get_computed_blocks(later))  # type: ignore[attr-defined]
    assert hits == [(((1, 2, 3, 4, 5), (0, 0, 0, 0, 12)), 20)] * 2


def test_vllm_033_cuts_blocks_for_computed_tokens_by_the_spec_block_as_the_model_does() -> None:
    """Decode context parallelism of 2: the manager's blocks hold 8 tokens, but 0.33.0's
    get_block_ids_for_computed_tokens divides by the spec's 4, so 6 tokens keep 2 blocks."""
    setup = ManagerSetup(8, (full_attention(4),), 64, 8, dcp_world_size=2)
    request = new_request("a", tuple(range(1, 20)), 8)
    answers = []
    for target in both(setup):
        assert target.allocate_slots(request, 19) == ((1, 2, 3),)  # type: ignore[attr-defined]
        answers.append(target.get_block_ids_for_computed_tokens("a", 6))  # type: ignore[attr-defined]
    assert answers == [((1, 2),)] * 2


@pytest.mark.parametrize(
    ("specs", "hit"),
    [
        # full attention of 8-token blocks: 32 tokens peeked, one block dropped, 24 aligned;
        # the window's run ends on the block past 24 (its peek) and is dropped back to 24
        ((full_attention(8), sliding_window(4, 5)), (((1, 2, 3), (0, 0, 0, 0, 0, 11)), 24)),
        # the window of 8-token blocks beside full attention of 4: the same 24 tokens
        ((full_attention(4), sliding_window(8, 5)), (((1, 2, 3, 4, 5, 6), (0, 0, 12)), 24)),
    ],
    ids=["wide-full", "wide-window"],
)
def test_vllm_033_eagle_on_two_block_sizes_hits_as_the_model_does(
    specs: tuple[Any, ...], hit: tuple[Any, int]
) -> None:
    """EAGLE's peek of the group's own block, its drop and the cut back to the scheduler
    block (8 tokens) together (HybridKVCacheCoordinator.find_longest_cache_hit in 0.33.0)."""
    setup = ManagerSetup(24, specs, 64, 4, use_eagle=True)
    first = new_request("a", tuple(range(1, 36)), 4)
    later = new_request("b", tuple(range(1, 34)), 4)
    hits = []
    for target in both(setup):
        target.allocate_slots(first, 35)  # type: ignore[attr-defined]
        hits.append(target.get_computed_blocks(later))  # type: ignore[attr-defined]
    assert hits == [hit, hit]


@pytest.mark.parametrize(
    ("specs", "eagle", "hit"),
    [
        ((full_attention(4),), False, 4),  # one group: 8 computed, 2 re-prefillable
        ((full_attention(4), full_attention(4)), True, 0),  # EAGLE also drops a block
        ((full_attention(4), full_attention(4)), False, 8),  # no EAGLE group: not held back
    ],
)
def test_vllm_033_holds_back_reprefillable_tokens_as_the_model_does(
    specs: tuple[Any, ...], eagle: bool, hit: int
) -> None:
    """num_prefill_lookahead=3: the last 2 computed tokens are not cached (0.33.0's
    get_num_cacheable_tokens), in the unitary coordinator and for EAGLE groups of a hybrid."""
    setup = ManagerSetup(16, specs, 32, 4, use_eagle=eagle, num_prefill_lookahead=3)
    first = new_request("a", tuple(range(1, 10)), 4)
    later = new_request("b", tuple(range(1, 13)), 4)
    hits = []
    for target in both(setup):
        target.allocate_slots(first, 8)  # type: ignore[attr-defined]
        hits.append(target.get_computed_blocks(later)[1])  # type: ignore[attr-defined]
    assert hits == [hit, hit]


def test_vllm_hybrids_with_eagle_and_lookaheads_conform() -> None:
    """The hybrids with EAGLE drawn in a third of the programs and look-aheads of 0 to 3."""
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    scope = _narrowed(
        layouts=tuple(layout for layout in VLLM_SCOPE.layouts if "+" in layout),
        prefill_lookaheads=(0, 1, 2, 3),
    )
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=150)
    assert report.conforms, f"{report.failure}\n{report.program}"


# --------------------------------------------------------------------------
# The scope, one layout or feature at a time
# --------------------------------------------------------------------------


def _narrowed(**fields: object) -> "ManagerTargetSpec":
    from dataclasses import replace

    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    return replace(VLLM_SCOPE, **fields)  # type: ignore[arg-type]


def test_vllm_chunked_local_attention_conforms() -> None:
    scope = _narrowed(layouts=("chunked_local", "full+chunked_local"))
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=60)
    assert report.conforms, f"{report.failure}\n{report.program}"


def test_vllm_mamba_conforms_with_prefix_caching_off() -> None:
    scope = _narrowed(layouts=("mamba",))
    assert "mamba" in scope.uncached_layouts
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=40)
    assert report.conforms, f"{report.failure}\n{report.program}"


def test_vllm_blocks_of_two_hash_blocks_conform() -> None:
    """Hybrids with blocks of two hash blocks: vLLM reads them through
    BlockHashListWithBlockSize; a single group only with caching off."""
    scope = _narrowed(block_factors=(2,))
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=80)
    assert report.conforms, f"{report.failure}\n{report.program}"


def test_vllm_events_conform() -> None:
    """The manager's take_events, in vLLM's event classes converted by the adapter."""
    scope = _narrowed(events=(True,))
    report = run_manager_conformance(scope, hypothesis_profile="ci", max_examples=80)
    assert report.conforms, f"{report.failure}\n{report.program}"


def test_vllm_033_keys_the_prompt_tail_beside_the_full_key_as_the_model_does() -> None:
    """A hybrid of blocks of two hash blocks, no fine-grained hits: once the block holding
    the prompt's last hit-able boundary (10 of 12 tokens) is full, 0.33 keys it there too,
    with a BlockStored of one hash block; the model does the same, event for event."""
    from kvpool.model.events import BlockStored
    from kvpool.model.single_type import full_attention

    setup = ManagerSetup(8, (full_attention(4), sliding_window(4, 2)), 16, 2, enable_events=True)
    request = new_request("r", (1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1), 2)
    streams = []
    for target in both(setup):
        assert target.allocate_slots(request, 10) is not None  # type: ignore[attr-defined]
        first = tuple(target.take_events())  # type: ignore[attr-defined]
        assert all(e.block_size == 4 for e in first)
        done = with_computed(request, 10)
        assert target.allocate_slots(done, 2) is not None  # type: ignore[attr-defined]
        streams.append((first, tuple(target.take_events())))  # type: ignore[attr-defined]
    assert streams[0] == streams[1]
    tail = [e for e in streams[0][1] if isinstance(e, BlockStored) and e.block_size == 2]
    assert [(e.block_hashes, e.token_ids, e.group_idx) for e in tail] == [
        ((request.block_hashes[4],), (2, 2), 0)
    ]


def test_vllm_refuses_what_the_scope_draws_with_caching_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two limits of the scope are vLLM's own: built anyway, its manager asserts."""
    from kvpool.model.single_type import full_attention, mamba
    from kvpool.specs.errors import TargetError
    from kvpool.specs.targets.vllm import request as adapter

    one_group = ManagerSetup(4, (full_attention(2),), 16, 1)
    with_mamba = ManagerSetup(4, (mamba(16),), 16, 1)
    assert "block_size == hash_block_size" in str(adapter.vllm_refuses(one_group))
    assert "align" in str(adapter.vllm_refuses(with_mamba))
    for setup in (one_group, with_mamba):
        from dataclasses import replace

        assert adapter.vllm_refuses(replace(setup, enable_caching=False)) is None
    monkeypatch.setattr(adapter, "vllm_refuses", lambda setup: None)
    with pytest.raises(TargetError, match="UnitaryKVCacheCoordinator assumes hash_block_size"):
        adapter.VllmManagerTarget(one_group)
    with pytest.raises(TargetError, match="mamba_cache_mode='align'"):
        adapter.VllmManagerTarget(with_mamba)


def test_an_event_of_another_group_kind_is_not_the_models() -> None:
    """The manager's annotations must name the group's spec; else the event never matches."""
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    from kvpool.model.events import BlockStored
    from kvpool.model.single_type import full_attention
    from kvpool.specs.targets.vllm.event_shape import UnmappedEvent
    from kvpool.specs.targets.vllm.request import manager_event

    def stored(kind: str) -> object:
        event = kv_events.BlockStored(
            block_hashes=[7],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None],
            group_idx=0,
        )
        event.kv_cache_spec_kind = kind
        return event

    names = {7: b"h"}.__getitem__
    ours = manager_event(stored("full_attention"), (full_attention(2),), names)
    assert not isinstance(ours, UnmappedEvent) and cast(BlockStored, ours).block_hashes == (b"h",)
    theirs = manager_event(stored("sliding_window"), (full_attention(2),), names)
    assert isinstance(theirs, UnmappedEvent)
