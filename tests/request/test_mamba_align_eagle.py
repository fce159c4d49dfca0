"""EAGLE beside a Mamba "align" group: the model's rules, their preconditions, and the impl in
lock-step (``kvpool.model.mamba_align_eagle``). The comparison with vLLM 0.33 itself is in
``test_vllm_mamba_align_eagle.py``.
"""

import copy
from dataclasses import replace
from typing import Any

import pytest

import kvpool.model.manager as manager
from kvpool.impl.mamba_align import MambaAlignManager, check_align_eagle
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import mamba_align as align
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.mamba_align_eagle import prompt_boundary, verify
from kvpool.model.pool import cache_full_blocks, evict_blocks, get_new_blocks, new_pool
from kvpool.model.request import Request, cache_request, new_request, with_computed
from kvpool.model.single_type import (
    KVCacheSpec,
    full_attention,
    mamba_align,
    mamba_reserving,
    sliding_window,
)
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.machine import _align_eagle_modelled
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import (
    MAMBA_ALIGN_GEOMETRY_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    ManagerSetup,
    ManagerTargetSpec,
)
from kvpool.specs.targets.impl.request import ImplManagerTarget
from tests.request.align_programs import RESEND_SETUP, latest_only_sibling, resend_scenario

# --------------------------------------------------------------------------
# Where the prompt's reusable state is
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt_tokens", "without", "with_eagle"),
    [(128, 96, 96), (127, 96, 64), (129, 128, 96), (32, 0, 0), (33, 32, 0), (31, 0, 0)],
)
def test_eagle_moves_the_prompt_boundary_one_block_below_the_last_within_the_prompt(
    num_prompt_tokens: int, without: int, with_eagle: int
) -> None:
    """vLLM 0.33's get_mamba_prefill_checkpoint_position: without EAGLE the last boundary
    before the prompt's last token; with it one hash block below the last boundary within
    the prompt (the attention groups read the whole prompt, then drop a block)."""
    assert prompt_boundary(num_prompt_tokens, 32, False) == without
    assert prompt_boundary(num_prompt_tokens, 32, True) == with_eagle


def _lost_key_at(position: int, prompt: list[int]) -> tuple[Any, tuple[int, ...], Request]:
    """A pool where a request's state blocks are keyed, then the one ending at ``position``
    lost its key (evicted): what ``cache_prompt_boundary`` keys again."""
    request = new_request("r", prompt, 2)
    pool, ids = get_new_blocks(new_pool(8, hash_block_size=2), 3)
    pool, _ = cache_full_blocks(pool, cache_request(request), ids, 0, 3, 2, 0)
    pool, _ = evict_blocks(pool, [ids[position // 2 - 1]])
    return pool, ids, request


def test_under_eagle_the_boundary_keyed_again_is_one_block_lower() -> None:
    """A prompt of 7 tokens in blocks of 2: the boundary is 6 without EAGLE, 4 with it. The
    block ending at 4 lost its key: caching up to 4 keys it again only under EAGLE."""
    prompt = [1, 2, 3, 4, 5, 6, 7]
    pool, ids, request = _lost_key_at(4, prompt)
    block = ids[1]
    for drop_eagle, keyed in ((False, False), (True, True)):
        after, table = align.cache_prompt_boundary(
            pool, align.AlignTable(), 0, 2, cache_request(request), 7, ids, 4, drop_eagle
        )
        assert (after.blocks[block].hash_num_tokens == 4) is keyed
        assert bool(table.cached_this_step) is keyed


def test_an_unflagged_align_group_moves_its_boundary_too() -> None:
    """vLLM 0.33 sets drop_eagle_checkpoint_block on every Mamba group whenever EAGLE is on,
    even when only another group is flagged as EAGLE's: the boundary follows the manager."""
    specs = (full_attention(2), mamba_align(2))
    kv = manager.new_kv_cache_manager(16, specs, 64, use_eagle=True, eagle_groups=[0])
    impl = KVCacheManager(KVCacheConfig(16, specs, eagle_groups=(0,)), 64, use_eagle=True)
    request = new_request("r", [1, 2, 3, 4, 5, 6, 7], 2)
    kv, _ = manager.allocate_slots(kv, request, 4)
    impl.allocate_slots(request, 4)
    state_block = kv.managers.tables[1].req_to_blocks["r"][1]
    kv, _ = manager.evict_blocks(kv, {state_block})
    impl.evict_blocks({state_block})
    kv, _ = manager.cache_blocks(kv, with_computed(request, 4), 4)
    impl.cache_blocks(with_computed(request, 4), 4)
    assert kv.managers.pool.blocks[state_block].hash_num_tokens == 4
    state_group = impl.managers[1]
    assert isinstance(state_group, MambaAlignManager)
    assert state_group.drop_eagle_checkpoint_block and not state_group.use_eagle


# --------------------------------------------------------------------------
# vLLM 0.33's own test, on the model and the impl
# --------------------------------------------------------------------------


def test_an_aligned_resend_and_a_sibling_reuse_the_retained_state() -> None:
    """With EAGLE the replay boundaries of a prompt of four blocks are 8 and 12: both states
    are kept under retention 0; the resend (capped at 15 tokens, full attention peeking to
    16 and dropping a block) and the longer sibling both hit 12 tokens."""
    model, impl = ModelManagerTarget(RESEND_SETUP), ImplManagerTarget(RESEND_SETUP)
    answers = resend_scenario(model)
    assert resend_scenario(impl) == answers
    resend, sibling = answers[-2], answers[-1]
    assert resend[1] == sibling[1] == 12
    assert [len(blocks) for blocks in resend[0]] == [3, 3]
    # the states at 8 and 12 only: the replay boundaries, retention 0 keeping nothing else
    state_keys = [key for key in model.snapshot().managers.pool.cached if key[1] == 1]
    assert len(state_keys) == 2


@pytest.mark.parametrize("eagle", [True, False])
def test_under_latest_only_retention_the_state_kept_is_eagles_boundary(eagle: bool) -> None:
    """Without EAGLE the replay boundary is 10 (the prompt's 11 - 1) and the state at 10 is
    kept (by the mask, and as the prompt's boundary): the sibling hits 10. With EAGLE the
    replay boundary and the prompt's boundary are 8, where this chunk left no state: the
    state at 10 is not kept, and the sibling misses."""
    setup = replace(
        ManagerSetup(8, (mamba_align(2),), 16, 2, use_eagle=eagle), retention_interval=0
    )
    answers = [
        latest_only_sibling(t) for t in (ModelManagerTarget(setup), ImplManagerTarget(setup))
    ]
    assert answers[0] == answers[1]
    assert answers[0][1][1] == (0 if eagle else 10)


# --------------------------------------------------------------------------
# The boundary keyed in the call that cached its block is offered
# --------------------------------------------------------------------------


def test_a_boundary_keyed_beside_the_full_blocks_is_offered_with_them() -> None:
    """A Mamba block of one token beside full attention's blocks of two, EAGLE, retention 0:
    a chunk of 5 of a 6-token prompt ends on the EAGLE boundary (5), which the retention
    mask (scheduler boundaries 2 and 4) leaves out; it is keyed as the prompt's boundary,
    and vLLM 0.33 offers it because it offers after both."""
    setup = ManagerSetup(8, (full_attention(2), mamba_align(1)), 16, 1, True, True)
    setup = replace(setup, retention_interval=0)
    offers = []
    for target in (ModelManagerTarget(setup), ImplManagerTarget(setup)):
        request = new_request("r", [1, 2, 2, 1, 1, 2], 1)
        hit, num_hit, _ = target.get_computed_blocks_with_boundary(request)
        target.allocate_slots(request, 5, num_hit, hit)
        offers.append(target.take_boundary_state_offloads())
    assert offers[0] == offers[1]
    assert [tokens for _, _, tokens in offers[0]["r"]] == [5]


# --------------------------------------------------------------------------
# The connector's per-group lookup
# --------------------------------------------------------------------------


def test_the_per_group_lookup_peeks_and_drops_under_eagle() -> None:
    """Five blocks of full attention cached, Mamba states at 4, 8, 12 and 20 (a chunk of 8
    skipped 16): a sibling sharing 16 tokens looks full attention up to 16 (its limit of 16
    plus a peeked block, within its hashes), drops a block and answers 12, where the Mamba
    state is: no group lags. Without EAGLE full attention answers 16 and the Mamba group lags."""
    prompt = [i for i in range(4) for _ in range(4)]
    answers = []
    for eagle in (True, False):
        setup = ManagerSetup(32, (full_attention(4), mamba_align(4)), 64, 4, use_eagle=eagle)
        for target in (ModelManagerTarget(setup), ImplManagerTarget(setup)):
            first = new_request("a", [*prompt, 5, 5, 5, 5], 4)
            for start, num_new in ((0, 4), (4, 4), (8, 4), (12, 8)):
                target.allocate_slots(with_computed(first, start), num_new)
                target.new_step_starts()
            hit, num_local, _, diverged = target.get_computed_blocks_for_connector(
                new_request("b", [*prompt, 7], 4)
            )
            answers.append((eagle, num_local, [len(g) for g in hit], diverged))
    assert answers == [
        (True, 12, [3, 3], False),
        (True, 12, [3, 3], False),
        (False, 16, [4, 3], True),
        (False, 16, [4, 3], True),
    ]


# --------------------------------------------------------------------------
# What stays refused, by name
# --------------------------------------------------------------------------


def test_invalid_eagle_beside_align_with_checkpoint_blocks() -> None:
    """Prefill checkpoint blocks under EAGLE (a checkpoint one block below the chunk's last
    boundary) are not modelled: the model and the impl refuse them by name, and leave the
    specs they read as they were."""
    specs = (full_attention(4), mamba_reserving(4, 1, 4))
    before = copy.deepcopy(specs)
    match = 'EAGLE beside a Mamba "align" group with prefill checkpoint blocks'
    with pytest.raises(InvalidManagerConfig, match=match):
        manager.new_kv_cache_manager(16, specs, 64, use_eagle=True)
    with pytest.raises(InvalidManagerConfig, match=match):
        KVCacheManager(KVCacheConfig(16, specs), 64, use_eagle=True)
    for check in (verify, check_align_eagle):
        with pytest.raises(InvalidManagerConfig, match=match):
            check(specs, True)
        check(specs, False)
    assert specs == before


@pytest.mark.parametrize(
    "specs",
    [
        (full_attention(4), mamba_align(4)),
        (mamba_align(4),),
        (sliding_window(4, 8), mamba_reserving(4, 3)),
        (full_attention(8), mamba_align(4)),
    ],
)
def test_eagle_beside_align_is_built_where_modelled(specs: tuple[KVCacheSpec, ...]) -> None:
    for interval in (None, 0, 8):
        kv = manager.new_kv_cache_manager(
            16, specs, 64, use_eagle=True, retention_interval=interval
        )
        impl = KVCacheManager(
            KVCacheConfig(16, specs, prefix_cache_retention_interval=interval), 64, use_eagle=True
        )
        assert impl.snapshot() == kv


def test_the_machine_draws_eagle_beside_align_only_where_modelled() -> None:
    assert _align_eagle_modelled((full_attention(4), mamba_align(4)), 4, 1, True)
    assert _align_eagle_modelled((full_attention(8), mamba_align(4)), 4, 1, True)
    assert _align_eagle_modelled((full_attention(4),), 4, 1, True)
    # hits inside a Mamba block, decode context parallelism, checkpoint blocks: refused
    assert not _align_eagle_modelled((full_attention(4), mamba_align(8)), 4, 1, True)
    assert _align_eagle_modelled((full_attention(4), mamba_align(8)), 4, 1, False)
    assert not _align_eagle_modelled((full_attention(8), mamba_align(4)), 4, 2, True)
    assert not _align_eagle_modelled((full_attention(4), mamba_reserving(4, 0, 4)), 4, 1, True)


# --------------------------------------------------------------------------
# The impl in lock-step with the model
# --------------------------------------------------------------------------


def test_impl_conforms_in_lock_step_with_eagle_beside_align() -> None:
    """The impl against the model on what ``mamba_align_eagle_scope()`` compares with vLLM."""
    from kvpool.model import DEFAULT_PROFILE

    scope = ManagerTargetSpec(
        ImplManagerTarget,
        layouts=MAMBA_ALIGN_LAYOUTS + MAMBA_ALIGN_GEOMETRY_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        min_window=2,
        hash_sized_layouts=MAMBA_ALIGN_LAYOUTS,
        scheduler_calls=True,
        mamba_reserves=((0, 0), (0, 0), (1, 0), (2, 0), (3, 0)),
        retentions=(None, None, 0, 0, 1, 2, 3),
        eagle_hybrids=True,
        eagle_flags=True,
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100
