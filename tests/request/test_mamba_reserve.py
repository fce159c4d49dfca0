"""Mamba "align" groups with prefill checkpoint and speculative blocks (kvpool.model.mamba_reserve).

The model's functions and preconditions, the impl in lock-step, and both against vLLM
0.33.0's own ``MambaManager`` (skipped, visibly, without vLLM; a failure without it
under ``KVPOOL_REQUIRE_VLLM=1``).
"""

import importlib
import os
from types import SimpleNamespace

import pytest

import kvpool.model.manager as manager
import kvpool.model.single_type as single
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import DEFAULT_PROFILE
from kvpool.model import mamba_reserve as reserve
from kvpool.model.errors import InvalidManagerConfig, InvalidTokenCount
from kvpool.model.mamba_align import AlignTable
from kvpool.model.pool import new_pool
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import (
    AttentionType,
    KVCacheSpec,
    full_attention,
    mamba_align,
    mamba_reserving,
)
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.machine import mamba_aligned_chunk
from kvpool.specs.request.target import MAMBA_ALIGN_LAYOUTS, ManagerSetup, ManagerTargetSpec
from kvpool.specs.targets.impl.request import ImplManagerTarget

PROMPT = list(range(22))
"""Five blocks of four tokens and a partial sixth."""

RESERVES = ((0, 4), (1, 0), (1, 4), (2, 8))
"""(speculative blocks, checkpoint alignment) with blocks of 4 tokens."""


def scenario(target: object) -> tuple[object, ...]:
    """A 12-token chunk, a 9-token chunk to the prompt's end, a sibling's hit, a decode."""
    t = target
    a = new_request("a", PROMPT, 4)
    first = t.allocate_slots(a, 12)  # type: ignore[attr-defined]
    second = t.allocate_slots(with_computed(a, 12), 9)  # type: ignore[attr-defined]
    t.new_step_starts()  # type: ignore[attr-defined]
    hit = t.get_computed_blocks(new_request("b", PROMPT, 4))  # type: ignore[attr-defined]
    decode = t.allocate_slots(with_computed(a, 21), 1)  # type: ignore[attr-defined]
    return first, second, hit, decode, t.get_block_ids("a")  # type: ignore[attr-defined]


EXPECTED = {
    # the checkpoints at 8 and 20 are real blocks and cached: the sibling hits 20 tokens
    (0, 4): (
        ((1, 2, 3), (0, 4, 5)),
        ((6, 7, 8), (0, 9, 10)),
        (((1, 2, 3, 6, 7), (0, 0, 0, 0, 9)), 20),
        ((), ()),
        ((1, 2, 3, 6, 7, 8), (0, 0, 0, 0, 0, 10)),
    ),
    # one speculative block past the state; the next chunk moves it to the end
    (1, 0): (
        ((1, 2, 3), (0, 0, 4, 5)),
        ((6, 7, 8), (0, 5, 9)),
        (((1, 2, 3), (0, 0, 4)), 12),
        ((), ()),
        ((1, 2, 3, 6, 7, 8), (0, 0, 0, 0, 0, 5, 9)),
    ),
}
"""What vLLM 0.33.0 answers to ``scenario`` (checked against it below)."""


# --------------------------------------------------------------------------
# The model's functions
# --------------------------------------------------------------------------


def model_target(S: int, alignment: int) -> object:
    from kvpool.specs.request.model_target import ModelManagerTarget

    return ModelManagerTarget(
        ManagerSetup(32, (full_attention(4), mamba_reserving(4, S, alignment)), 64, 4)
    )


def test_a_chunk_of_two_blocks_or_more_keeps_its_checkpoint_and_caches_it() -> None:
    assert scenario(model_target(0, 4)) == EXPECTED[(0, 4)]


def test_speculative_blocks_follow_the_state_and_move_to_the_end() -> None:
    assert scenario(model_target(1, 0)) == EXPECTED[(1, 0)]


def test_a_checkpoint_needs_a_chunk_starting_on_a_boundary_two_blocks_long() -> None:
    assert reserve.checkpoint_valid(0, 8, 4, 4, 4)
    assert reserve.checkpoint_valid(0, 5, 4, 4, 4)  # the state at 5 goes in the next block
    assert not reserve.checkpoint_valid(0, 4, 0, 4, 4)  # one block: nothing before its end
    assert not reserve.checkpoint_valid(2, 12, 8, 4, 2)  # starts inside a block
    assert not reserve.checkpoint_valid(0, 12, 8, 4, 3)  # not a multiple of the alignment
    assert reserve.checkpoint_valid(0, 12, 8, 4, 8)


def test_a_checkpoint_is_not_planned_where_the_table_holds_a_real_block() -> None:
    table = reserve.plan_checkpoint(AlignTable(), 4, 0, 4, "r", (0, 5), 0, 12, 4)
    assert "r" not in table.checkpoints  # index 1 holds block 5 already
    table = reserve.plan_checkpoint(AlignTable(), 4, 0, 4, "r", (0, 0), 0, 12, 4)
    assert table.checkpoints == {"r": (8, 1)}
    # a request allocated before may put it on one of its speculative blocks
    allocated = AlignTable(allocated=frozenset({"r"}))
    assert reserve.plan_checkpoint(allocated, 4, 1, 4, "r", (0, 5), 0, 12, 4).checkpoints


def test_a_lost_checkpoint_key_is_restored_when_caching_again() -> None:
    kv = manager.new_kv_cache_manager(16, [full_attention(4), mamba_reserving(4, 0, 4)], 64)
    a = new_request("a", PROMPT, 4)
    kv, blocks = manager.allocate_slots(kv, a, 12, delay_cache_blocks=True)
    assert blocks == ((1, 2, 3), (0, 4, 5))
    kv, _ = manager.cache_blocks(kv, a, 4)  # the checkpoint at 8 is keyed all the same
    assert kv.managers.pool.blocks[4].hash_num_tokens == 8


def test_the_checkpoint_is_forgotten_with_the_request() -> None:
    kv = manager.new_kv_cache_manager(16, [full_attention(4), mamba_reserving(4, 0, 4)], 64)
    kv, _ = manager.allocate_slots(kv, new_request("a", PROMPT, 4), 12)
    assert kv.managers.tables[1].align.checkpoints == {"a": (8, 1)}
    kv, _ = manager.free(kv, "a")
    assert kv.managers.tables[1].align.checkpoints == {}


def test_the_scheduler_lets_a_last_chunk_that_exports_its_checkpoint_run_to_the_end() -> None:
    request = new_request("r", range(10), 4)
    assert mamba_aligned_chunk(request, 0, 10, 4) == 8
    assert mamba_aligned_chunk(request, 0, 10, 4, 4) == 10
    assert mamba_aligned_chunk(request, 0, 10, 4, 3) == 8  # cannot export it: split as before


# --------------------------------------------------------------------------
# Preconditions
# --------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_speculative_blocks", "prefill_checkpoint_alignment"])
@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_invalid_reserved_block_count(field: str, value: object) -> None:
    spec = KVCacheSpec(AttentionType.MAMBA, 4, mamba_align=True, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidManagerConfig, match=field):
        manager.new_kv_cache_manager(8, [spec], 64)
    with pytest.raises(InvalidManagerConfig, match=field):
        KVCacheManager(KVCacheConfig(8, (spec,)), 64)


@pytest.mark.parametrize("field", ["num_speculative_blocks", "prefill_checkpoint_alignment"])
def test_invalid_reserved_blocks_outside_align_mode(field: str) -> None:
    for spec in (
        KVCacheSpec(AttentionType.FULL, 4, **{field: 4}),  # type: ignore[arg-type]
        KVCacheSpec(AttentionType.MAMBA, 64, dcp_sharded=False, **{field: 4}),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidManagerConfig, match=field):
            manager.new_kv_cache_manager(8, [spec], 64, enable_caching=False)
        with pytest.raises(InvalidManagerConfig, match=field):
            KVCacheManager(KVCacheConfig(8, (spec,)), 64, enable_caching=False)


def test_invalid_chunk_out_of_order() -> None:
    m = single.new_managers(new_pool(8), [mamba_reserving(4, 0, 4)])
    before = m
    with pytest.raises(InvalidTokenCount):
        single.plan_checkpoint(m, 0, "r", 8, 4, 4)
    assert m == before


def test_invalid_checkpoints_with_a_longer_hash_look_ahead() -> None:
    """vLLM leaves ``max(1, L)`` tokens before the checkpoint; kvpool models L <= 1."""
    specs = (full_attention(4), mamba_reserving(4, 0, 4))
    KVCacheManager(KVCacheConfig(8, specs), 64, num_hash_lookahead_tokens=1)
    with pytest.raises(InvalidManagerConfig, match="num_hash_lookahead_tokens"):
        KVCacheManager(KVCacheConfig(8, specs), 64, num_hash_lookahead_tokens=2)


def test_a_vllm_spec_with_reserved_blocks_becomes_a_reserving_group() -> None:
    def config(**fields: object) -> SimpleNamespace:
        MambaSpec = type("MambaSpec", (), {"block_size": 4, "mamba_cache_mode": "align"})
        spec = MambaSpec()
        for name, value in fields.items():
            setattr(spec, name, value)
        return SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])

    both = config(
        num_speculative_blocks=1, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=4
    )
    assert KVCacheManager(both, 64).specs == (mamba_reserving(4, 1, 4),)
    # checkpoint blocks without an alignment never checkpoint (vLLM's validity test)
    unaligned = config(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=None)
    assert KVCacheManager(unaligned, 64).specs == (mamba_align(4),)


def test_the_json_protocol_carries_reserved_blocks() -> None:
    from jsonschema import Draft202012Validator

    from kvpool.specs.protocol.request_codec import decode_spec, encode_spec
    from kvpool.specs.vectors.format import load_schema

    schema = load_schema("request-protocol-v1.json")
    group = Draft202012Validator({**schema["$defs"]["spec"], "$defs": schema["$defs"]})
    spec = mamba_reserving(4, 2, 8)
    group.validate(encode_spec(spec))
    assert decode_spec(encode_spec(spec)) == spec
    assert "num_speculative_blocks" not in encode_spec(mamba_align(4))


# --------------------------------------------------------------------------
# The impl in lock-step, and vLLM
# --------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_impl_conforms_with_reserved_blocks(level: int) -> None:
    """In lock-step with the model, the scheduler's further calls included (admission of
    whole sequences, popping for a deferred free); level 2 adds rejected calls."""
    scope = ManagerTargetSpec(
        ImplManagerTarget,
        layouts=MAMBA_ALIGN_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        hash_sized_layouts=MAMBA_ALIGN_LAYOUTS,
        mamba_reserves=((0, 1), (0, 2), (1, 0), (2, 0), (1, 1)),
        scheduler_calls=True,
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=100, level=level)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


def _require_vllm() -> None:
    try:
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as error:  # ImportError, or a dependency failing at import time
        reason = f"vLLM's KVCacheManager cannot be imported: {error!r}"
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_VLLM=1 to make this an error)")


@pytest.mark.parametrize("reserved", RESERVES)
def test_the_model_and_impl_answer_as_vllm(reserved: tuple[int, int]) -> None:
    _require_vllm()
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    setup = ManagerSetup(32, (full_attention(4), mamba_reserving(4, *reserved)), 64, 4)
    vllm = scenario(VllmManagerTarget(setup))
    assert scenario(model_target(*reserved)) == vllm
    assert scenario(ImplManagerTarget(setup)) == vllm
    if reserved in EXPECTED:
        assert vllm == EXPECTED[reserved]


def test_vllm_with_reserved_blocks_conforms_at_level_1() -> None:
    _require_vllm()
    from dataclasses import replace

    from kvpool.specs.targets.vllm.request import mamba_align_scope

    scope = replace(mamba_align_scope(), mamba_reserves=((0, 1), (0, 2), (1, 0), (2, 0), (1, 1)))
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=200)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 200


def test_invalid_reserved_blocks_off_the_modelled_geometry() -> None:
    """Blocks of several hash blocks (caching on) or smaller than the scheduler's: vLLM then
    keys checkpoints inside a block; refused by name (today the "align" geometry checks
    refuse these first: this guards the merge that lifts them)."""
    specs = [full_attention(4), mamba_reserving(4, 1, 4)]
    reserve.verify_reserving_geometry(specs, 4, 4)
    reserve.verify_reserving_geometry(specs, 0, 4)  # caching off: any hash block
    with pytest.raises(InvalidManagerConfig, match="reserved blocks"):
        reserve.verify_reserving_geometry(specs, 2, 4)
    with pytest.raises(InvalidManagerConfig, match="reserved blocks"):
        reserve.verify_reserving_geometry(specs, 0, 8)
    reserve.verify_reserving_geometry([full_attention(4), mamba_align(4)], 2, 8)  # reserves none


def test_caching_off_checkpoints_use_the_hash_block() -> None:
    """Without caching a block may hold several hash blocks: a chunk may then start on a
    hash boundary inside a block and still checkpoint (vLLM's validity test reads the
    hash block size)."""
    assert reserve.checkpoint_valid(2, 12, 8, 4, 2, hash_block_size=2)
    assert not reserve.checkpoint_valid(2, 12, 8, 4, 2)


def test_invalid_caching_with_a_checkpoint_past_the_table() -> None:
    """An allocation refused after its count recorded a checkpoint past the table: caching
    the request then fails by name (vLLM 0.33 asserts), in the model and the impl alike,
    and neither changes."""
    from kvpool.model.errors import InvalidBlockRange

    specs = (mamba_reserving(1, 0, 1),)
    a = new_request("a", [5, 6, 7, 8], 1)
    kv = manager.new_kv_cache_manager(2, specs, 16, hash_block_size=1)
    impl = KVCacheManager(KVCacheConfig(2, specs), 16, hash_block_size=1)
    kv, _ = manager.allocate_slots(kv, a, 1)
    impl.allocate_slots(a, 1)
    kv, refused = manager.allocate_slots(kv, with_computed(a, 1), 2)
    assert refused is None and impl.allocate_slots(with_computed(a, 1), 2) is None
    assert kv.managers.tables[0].align.checkpoints == {"a": (2, 1)}
    before = kv
    with pytest.raises(InvalidBlockRange):
        manager.cache_blocks(kv, with_computed(a, 1), 1)
    assert kv == before
    with pytest.raises(InvalidBlockRange):
        impl.cache_blocks(with_computed(a, 1), 1)
    assert impl.snapshot() == before


def admission_and_pop(target: object) -> tuple[object, ...]:
    """A whole-sequence admission that fits only with "align"'s cap; a request popped for
    freeing, then a sibling hitting the state it cached in this step."""
    t = target
    a = new_request("a", list(range(40)), 4)
    admitted = t.allocate_slots(a, 12, 0, None, 0, False, full_sequence_must_fit=True)  # type: ignore[attr-defined]
    popped = t.pop_blocks_for_free(a)  # type: ignore[attr-defined]
    b = new_request("b", list(range(40)), 4)
    hit = t.get_computed_blocks(b)  # type: ignore[attr-defined]
    waits = t.allocate_slots(b, 4, hit[1], hit[0])  # type: ignore[attr-defined]
    return admitted, popped, hit, waits


@pytest.mark.parametrize("reserved", [(0, 0), *RESERVES])
def test_admission_and_pop_answer_as_vllm(reserved: tuple[int, int]) -> None:
    """vLLM 0.33 counts an "align" group's whole sequence as one allocation would (at most a
    block, a checkpoint's and the speculative ones), and ``pop_blocks_for_free`` forgets
    only the popped request's "align" records: the state it cached this step still makes
    a sibling wait."""
    _require_vllm()
    from kvpool.specs.request.model_target import ModelManagerTarget
    from kvpool.specs.targets.vllm.request import VllmManagerTarget

    spec = mamba_reserving(4, *reserved) if reserved != (0, 0) else mamba_align(4)
    setup = ManagerSetup(16, (full_attention(4), spec), 64, 4)  # 10 + 1 to 4 blocks
    vllm = admission_and_pop(VllmManagerTarget(setup))
    assert vllm[0] is not None and vllm[3] is None  # admitted; the sibling waits
    assert admission_and_pop(ModelManagerTarget(setup)) == vllm
    assert admission_and_pop(ImplManagerTarget(setup)) == vllm


def test_invalid_caching_past_an_align_table_changes_no_group() -> None:
    """Caching past the end of a Mamba "align" group's table is refused before any group
    caches: the impl had let the full-attention group cache first (found by the impl's
    lock-step at level 2 with the scheduler calls)."""
    from kvpool.model.errors import InvalidBlockRange

    specs = (full_attention(1), mamba_align(1))
    a = new_request("r0", [1, 2, 2, 1, 1, 2, 1, 2, 2, 2, 1, 1], 1)
    kv = manager.new_kv_cache_manager(9, specs, 16, hash_block_size=1)
    impl = KVCacheManager(KVCacheConfig(9, specs), 16, hash_block_size=1)
    for request, num_new, lookahead in ((a, 4, 0), (with_computed(a, 4), 1, 1)):
        kv, _ = manager.allocate_slots(kv, request, num_new, num_lookahead_tokens=lookahead)
        impl.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
    before = kv
    with pytest.raises(InvalidBlockRange):
        manager.cache_blocks(kv, with_computed(a, 5), 6)
    with pytest.raises(InvalidBlockRange):
        impl.cache_blocks(with_computed(a, 5), 6)
    assert impl.snapshot() == before
