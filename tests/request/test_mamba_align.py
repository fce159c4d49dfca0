"""Mamba "align" mode: the model's functions, their preconditions, and the impl in lock-step.

vLLM 0.33.0's ``MambaManager`` with ``mamba_cache_mode == "align"``
(``kvpool.model.mamba_align``); the comparison with vLLM itself is in
``test_vllm_mamba_align.py``.
"""

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

import kvpool.model.manager as manager
from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import mamba_align as align
from kvpool.model.errors import InvalidManagerConfig, InvalidTokenCount
from kvpool.model.pool import cache_full_blocks, get_new_blocks, new_pool
from kvpool.model.request import Request, append_tokens, cache_request, new_request, with_computed
from kvpool.model.single_type import (
    AttentionType,
    KVCacheSpec,
    full_attention,
    mamba_align,
    sliding_window,
)
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.machine import mamba_aligned_chunk
from kvpool.specs.request.target import (
    MAMBA_ALIGN_GEOMETRY_LAYOUTS,
    MAMBA_ALIGN_LAYOUTS,
    ManagerTargetSpec,
)
from kvpool.specs.targets.impl.request import ImplManagerTarget

PROMPT = [i for i in range(3) for _ in range(4)] + [3, 3]
"""Three blocks of four tokens and a partial fourth."""


def hybrid(num_blocks: int = 16) -> manager.KVCacheManagerState:
    return manager.new_kv_cache_manager(num_blocks, [full_attention(4), mamba_align(4)], 64)


def step(
    kv: manager.KVCacheManagerState, request: Request, num_new: int
) -> tuple[manager.KVCacheManagerState, manager.Blocks | None]:
    kv, blocks = manager.allocate_slots(kv, request, num_new)
    kv, _ = manager.new_step_starts(kv)
    return kv, blocks


# --------------------------------------------------------------------------
# What a request holds
# --------------------------------------------------------------------------


def test_a_chunk_gets_one_state_block_where_it_ends_and_nulls_before_it() -> None:
    _kv, blocks = step(hybrid(), new_request("a", PROMPT, 4), 12)
    assert blocks == ((1, 2, 3), (0, 0, 4))


def test_the_previous_state_is_released_once_the_computed_tokens_pass_it() -> None:
    a = new_request("a", PROMPT + [4] * 6, 4)
    kv, _ = step(hybrid(), a, 8)
    kv, _ = step(kv, with_computed(a, 8), 4)  # state 8 kept: the worker copies from it
    assert manager.get_block_ids(kv, "a")[1] == (0, 3, 5)
    kv, _ = step(kv, with_computed(a, 12), 4)  # now both earlier states go
    assert manager.get_block_ids(kv, "a")[1] == (0, 0, 5, 7)
    assert kv.managers.tables[1].align.last_state["a"] == 2


def test_a_decode_inside_the_state_block_allocates_nothing() -> None:
    a = new_request("a", PROMPT, 4)
    kv, _ = step(hybrid(), a, 13)
    kv, blocks = step(kv, with_computed(a, 13), 1)
    assert blocks == ((), ())


# --------------------------------------------------------------------------
# Where a hit may end
# --------------------------------------------------------------------------


def test_a_hit_is_the_last_cached_boundary_with_nulls_before_it() -> None:
    kv, _ = step(hybrid(), new_request("a", PROMPT, 4), 12)
    b = new_request("b", [*PROMPT[:12], 9], 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    assert (hit, num_hit) == (((1, 2, 3), (0, 0, 4)), 12)


def test_a_boundary_no_chunk_ended_on_has_no_state_and_no_hit() -> None:
    # one chunk of 14 tokens: only the block of token 14 holds a state (never cached)
    kv, _ = step(hybrid(), new_request("a", PROMPT, 4), 14)
    kv, (_, num_hit) = manager.get_computed_blocks(kv, new_request("b", [*PROMPT[:12], 9], 4))
    assert num_hit == 0


def test_find_hit_searches_from_the_right() -> None:
    pool, (b1, b2) = get_new_blocks(new_pool(4, hash_block_size=2), 2)
    request = cache_request(new_request("r", [1, 2, 3, 4, 5], 2))
    pool, _ = cache_full_blocks(pool, request, (b1, b2), 0, 2, 2, 0)
    assert align.find_hit(pool, 2, request.block_hashes, 4, [0]) == ((0, b2),)
    assert align.find_hit(pool, 2, request.block_hashes, 3, [0]) == ((b1,),)


def test_invalid_negative_max_length() -> None:
    pool = new_pool(4)
    with pytest.raises(InvalidTokenCount):
        align.find_hit(pool, 1, [b"h"], -1, [0])


# --------------------------------------------------------------------------
# What is cached, and when a hit may be taken
# --------------------------------------------------------------------------


def test_a_state_cached_this_step_is_hit_only_in_the_next() -> None:
    kv, _ = manager.allocate_slots(hybrid(), new_request("a", PROMPT, 4), 12)
    b = new_request("b", [*PROMPT[:12], 9], 4)
    kv, (hit, num_hit) = manager.get_computed_blocks(kv, b)
    before = kv
    kv, blocks = manager.allocate_slots(kv, b, 1, num_hit, hit)
    assert blocks is None and kv == before  # refused: the state is written by this step
    kv, _ = manager.new_step_starts(kv)
    assert manager.allocate_slots(kv, b, 1, num_hit, hit)[1] == ((5,), (6,))


def test_cached_states_are_offered_to_a_connector_until_taken_or_freed() -> None:
    a = new_request("a", PROMPT, 4)
    kv, _ = step(hybrid(), a, 8)
    kv, _ = step(kv, with_computed(a, 8), 4)
    table, offers = align.take_offloads(kv.managers.tables[1].align)
    assert offers == (("a", 1, 3, 8), ("a", 1, 5, 12))
    assert table.offloads == ()
    kv, _ = manager.free(kv, "a")
    assert kv.managers.tables[1].align == align.AlignTable()


def test_the_prompt_boundary_is_keyed_again_after_an_eviction() -> None:
    a = new_request("a", PROMPT, 4)
    kv, _ = step(hybrid(), a, 12)
    kv, _ = manager.evict_blocks(kv, {4})
    assert kv.managers.pool.blocks[4].block_hash is None
    kv, _ = manager.cache_blocks(kv, with_computed(a, 12), 12)
    assert kv.managers.pool.blocks[4].hash_num_tokens == 12


# --------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------


def test_invalid_align_mode_on_an_attention_group() -> None:
    spec = KVCacheSpec(AttentionType.FULL, 4, mamba_align=True)
    with pytest.raises(InvalidManagerConfig):
        manager.new_kv_cache_manager(8, [spec], 64)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(KVCacheConfig(8, (spec,)), 64)


def test_invalid_hash_blocks_smaller_than_the_align_block_beside_a_window() -> None:
    """Hits inside a Mamba block are modelled beside full attention only
    (kvpool.model.mamba_fine_config; tests/request/test_mamba_fine.py)."""
    specs = [sliding_window(4, 4), mamba_align(4)]
    with pytest.raises(InvalidManagerConfig):
        manager.new_kv_cache_manager(8, specs, 64, hash_block_size=2)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(KVCacheConfig(8, tuple(specs)), 64, hash_block_size=2)
    # beside full attention they are; without caching there are no hits to end inside a block
    manager.new_kv_cache_manager(8, [full_attention(4), mamba_align(4)], 64, hash_block_size=2)
    manager.new_kv_cache_manager(8, specs, 64, hash_block_size=2, enable_caching=False)


@pytest.mark.parametrize(
    "field",
    [
        # reserved blocks are modelled in "align" mode only (kvpool.model.mamba_reserve)
        {"mamba_cache_mode": "none", "num_speculative_blocks": 1},
        {"mamba_cache_mode": "none", "num_prefill_checkpoint_blocks": 1},
        {"mamba_cache_mode": "all"},
    ],
)
def test_invalid_mamba_spec_parts_not_modelled(field: dict[str, object]) -> None:
    MambaSpec = type("MambaSpec", (), {})  # read by class name, as vLLM's is
    spec = MambaSpec()
    # blocks of a whole request: a "none" group is refused for the field, not its size
    for name, value in {"block_size": 64, "mamba_cache_mode": "align", **field}.items():
        setattr(spec, name, value)
    config = SimpleNamespace(num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    with pytest.raises(InvalidManagerConfig, match=list(field)[-1]):
        KVCacheManager(config, 64, enable_caching=False)


@pytest.mark.parametrize("interval", [0, 32])
def test_invalid_sparse_retention_with_checkpoint_blocks(interval: int) -> None:
    """vLLM 0.33 reserves and keys prefill checkpoints by the retention interval too: not
    modelled, so refused, not ignored (bare "align" groups thin their states:
    tests/request/test_align_retention.py)."""
    config = SimpleNamespace(
        num_blocks=8,
        kv_cache_groups=[replace(mamba_align(4), prefill_checkpoint_alignment=4)],
        prefix_cache_retention_interval=interval,
    )
    with pytest.raises(InvalidManagerConfig, match="prefill checkpoints"):
        KVCacheManager(config, 64)


def test_a_vllm_align_spec_becomes_a_mamba_align_group() -> None:
    MambaSpec = type("MambaSpec", (), {"block_size": 4, "mamba_cache_mode": "align"})
    config = SimpleNamespace(
        num_blocks=8, kv_cache_groups=[SimpleNamespace(kv_cache_spec=MambaSpec())]
    )
    assert KVCacheManager(config, 64).specs == (mamba_align(4),)


# --------------------------------------------------------------------------
# The scheduler's chunks
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "num_new", "expected"),
    [
        (0, 6, 4),  # a prefill chunk ends on a boundary
        (0, 3, 0),  # ... or is not scheduled
        (2, 6, 2),  # from inside a block: to the next boundary
        (8, 3, 3),  # the last chunk ends the prefill (9 prompt tokens, 2 output) unsplit
        (0, 10, 8),  # never past the last boundary before the last token
        (10, 1, 1),  # decoding is not split
    ],
)
def test_chunks_split_as_the_scheduler_does(start: int, num_new: int, expected: int) -> None:
    request = new_request("r", range(9), 4)
    request = with_computed(request, 0)
    request = append_tokens(request, [1, 1])  # 11 tokens, prefill ends at 10
    assert mamba_aligned_chunk(request, start, num_new, 4) == expected


# --------------------------------------------------------------------------
# The impl in lock-step with the model
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_impl_matches_model_call_by_call(seed: int) -> None:
    rnd = random.Random(seed)
    specs = [
        (full_attention(4), mamba_align(4)),
        (mamba_align(4),),
        (sliding_window(4, 8), mamba_align(4), mamba_align(4)),
    ][seed % 3]
    kv = manager.new_kv_cache_manager(24, specs, 64)
    impl = KVCacheManager(KVCacheConfig(24, specs), 64)
    requests: dict[str, Request] = {}
    base = [0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 1]
    for _ in range(40):
        roll = rnd.random()
        rid = str(rnd.randrange(4))
        if roll < 0.5 and rid not in requests:
            length = rnd.randrange(2, 17)
            r = new_request(rid, base[:length] if rnd.random() < 0.7 else [1] * length, 4)
            kv, (hit, num_hit) = manager.get_computed_blocks(kv, r)
            impl_hit, impl_num, _ = impl.get_computed_blocks(r)
            assert (num_hit, hit) == (impl_num, tuple(map(tuple, impl_hit.get_block_ids())))
            k = rnd.randrange(1, r.num_tokens - num_hit + 1)
            kv, got = manager.allocate_slots(kv, r, k, num_hit, hit if num_hit else None)
            impl_got = impl.allocate_slots(r, k, num_hit, impl_hit if num_hit else None)
            assert got == (
                None if impl_got is None else tuple(map(tuple, impl_got.get_block_ids()))
            )
            if got is not None:
                requests[rid] = with_computed(r, num_hit + k)
        elif roll < 0.5:
            r = requests[rid]
            left = r.num_tokens - r.num_computed_tokens
            if left > 0:
                k = rnd.randrange(1, left + 1)
                kv, got = manager.allocate_slots(kv, r, k)
                impl_got = impl.allocate_slots(r, k)
                assert got == (
                    None if impl_got is None else tuple(map(tuple, impl_got.get_block_ids()))
                )
                if got is not None:
                    requests[rid] = with_computed(r, r.num_computed_tokens + k)
        elif roll < 0.65 and requests:
            rid = rnd.choice(sorted(requests))
            kv, _ = manager.free(kv, rid)
            impl.free(requests.pop(rid))
        elif roll < 0.8:
            kv, _ = manager.new_step_starts(kv)
            impl.new_step_starts()
        else:
            ids = {rnd.randrange(1, 24)}
            kv, _ = manager.evict_blocks(kv, ids)
            impl.evict_blocks(ids)
        assert impl.snapshot() == kv
    assert any(t.align.allocated for t in kv.managers.tables) or not requests


def test_impl_conforms_on_the_mamba_align_layouts() -> None:
    from kvpool.model import DEFAULT_PROFILE

    scope = ManagerTargetSpec(
        ImplManagerTarget,
        layouts=MAMBA_ALIGN_LAYOUTS + MAMBA_ALIGN_GEOMETRY_LAYOUTS,
        profiles=(DEFAULT_PROFILE,),
        events=(False, True),
        block_factors=(1, 2),
        min_window=2,
        hash_sized_layouts=MAMBA_ALIGN_LAYOUTS,
        scheduler_calls=True,
    )
    report = run_request_conformance(scope, hypothesis_profile="ci", max_examples=100)
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 100


def test_the_json_protocol_carries_the_align_mode() -> None:
    """A Mamba "align" group says so in the request protocol's group spec; other groups'
    JSON is unchanged (no key)."""
    from jsonschema import Draft202012Validator

    from kvpool.specs.protocol.codec import ProtocolError
    from kvpool.specs.protocol.request_codec import decode_spec, encode_spec
    from kvpool.specs.vectors.format import load_schema

    schema = load_schema("request-protocol-v1.json")
    group = Draft202012Validator({**schema["$defs"]["spec"], "$defs": schema["$defs"]})
    for spec in (mamba_align(4), full_attention(4)):
        encoded = encode_spec(spec)
        group.validate(encoded)
        assert decode_spec(encoded) == spec
    assert "mamba_align" not in encode_spec(full_attention(4))
    with pytest.raises(ProtocolError):
        decode_spec({**encode_spec(mamba_align(4)), "mamba_align": "yes"})
