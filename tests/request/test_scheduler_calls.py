"""The rest of vLLM 0.33's scheduler calls, model and impl: the deferred free, a KV connector's
calls, zeroing records, and admitting a request only if its whole sequence fits.

Each precondition has a ``test_invalid_*`` on the model and on the impl (the impl's
with a snapshot before and after); the machine runs the impl against the model
with the calls (``scheduler_calls=True``), and its programs replay through the
scenario format.
"""

import json
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import manager as M
from kvpool.model import scheduler_calls as S
from kvpool.model.admission import max_admission_blocks
from kvpool.model.errors import InvalidArgument, InvalidManagerConfig, InvalidTokenCount
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import (
    KVCacheSpec,
    chunked_local,
    full_attention,
    mamba,
    sliding_window,
)
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.targets.impl.request import ImplManagerTarget
from kvpool.specs.teaching import request_scenarios

WINDOW = (sliding_window(2, 3),)
HYBRID_MAMBA = (full_attention(16), mamba(16))
PROMPT = [1, 2, 1, 1, 2, 2, 1, 2]


def both(specs: tuple[KVCacheSpec, ...], num_blocks: int = 12, **kwargs: Any) -> tuple[Any, Any]:
    model = M.new_kv_cache_manager(num_blocks, specs, 16, **kwargs)
    impl = KVCacheManager(KVCacheConfig(num_blocks, specs), 16, **kwargs)
    return model, impl


def ids(blocks: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in blocks)


# --------------------------------------------------------------------------
# pop_blocks_for_free
# --------------------------------------------------------------------------


def test_pop_hands_back_held_blocks_without_leading_nulls_and_forgets_the_request() -> None:
    model, impl = both((full_attention(2), sliding_window(2, 3)))
    r = new_request("r", PROMPT, 2)
    model, _ = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    r = with_computed(r, 8)
    model, _ = M.allocate_slots(model, r, 1)  # the window's first blocks turn null
    impl.allocate_slots(r, 1)
    free_before = M.num_free_blocks(model)
    assert M.get_block_ids(model, "r") == ((1, 2, 3, 4, 9), (0, 0, 0, 8, 10))
    model, popped = S.pop_blocks_for_free(model, "r")
    assert popped == (1, 2, 3, 4, 9, 8, 10)
    assert 0 not in popped
    assert M.num_free_blocks(model) == free_before
    assert M.get_block_ids(model, "r") == ((), ())
    assert tuple(b.block_id for b in impl.pop_blocks_for_free(r)) == popped
    assert impl.snapshot() == model
    model, _ = M.free_blocks(model, popped[::-1])
    impl.block_pool.free_blocks(
        [impl.block_pool.blocks[b] for b in popped[::-1]]  # the scheduler's later free
    )
    assert impl.snapshot() == model
    assert M.num_free_blocks(model) == 11


def test_pop_of_a_request_holding_nothing_changes_nothing() -> None:
    model, impl = both(WINDOW)
    assert S.pop_blocks_for_free(model, "nobody") == (model, ())
    assert impl.pop_blocks_for_free(new_request("nobody", [1], 2)) == []


def test_invalid_argument_pop_without_a_request_id() -> None:
    _, impl = both(WINDOW)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.pop_blocks_for_free(object())
    assert impl.snapshot() == before


# --------------------------------------------------------------------------
# remove_skipped_blocks and get_block_ids_for_computed_tokens
# --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [sliding_window(2, 3), chunked_local(2, 4), full_attention(2)])
def test_remove_skipped_blocks_frees_what_allocate_slots_would(spec: KVCacheSpec) -> None:
    model, impl = both((spec,))
    r = new_request("r", PROMPT, 2)
    model, _ = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    model, _ = S.remove_skipped_blocks(model, "r", 7)
    impl.remove_skipped_blocks("r", 7)
    assert impl.snapshot() == model
    expected = {"sliding_window": (0, 0, 3, 4), "chunked_local_attention": (0, 0, 3, 4)}
    assert M.get_block_ids(model, "r")[0] == expected.get(spec.attention.value, (1, 2, 3, 4))


def test_block_ids_for_computed_tokens_cut_attention_groups_not_mamba() -> None:
    model, impl = both((sliding_window(2, 3),))
    r = new_request("r", PROMPT, 2)
    model, _ = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    assert S.get_block_ids_for_computed_tokens(model, "r", 3) == ((1, 2),)
    assert ids(impl.get_block_ids_for_computed_tokens("r", 3)) == ((1, 2),)
    assert S.get_block_ids_for_computed_tokens(model, "r", 0) == ((),)
    hybrid, hybrid_impl = both(HYBRID_MAMBA, enable_caching=False, hash_block_size=2)
    hybrid, _ = M.allocate_slots(hybrid, r, 8)
    hybrid_impl.allocate_slots(r, 8)
    assert S.get_block_ids_for_computed_tokens(hybrid, "r", 0) == ((), (2,))
    assert ids(hybrid_impl.get_block_ids_for_computed_tokens("r", 0)) == ((), (2,))


@pytest.mark.parametrize("call", ["remove_skipped_blocks", "get_block_ids_for_computed_tokens"])
def test_invalid_token_count_negative(call: str) -> None:
    model, impl = both(WINDOW)
    before = impl.snapshot()
    with pytest.raises(InvalidTokenCount):
        getattr(S, call)(model, "r", -1)
    with pytest.raises(InvalidTokenCount):
        getattr(impl, call)("r", -1)
    assert impl.snapshot() == before


@pytest.mark.parametrize("call", ["remove_skipped_blocks", "get_block_ids_for_computed_tokens"])
@pytest.mark.parametrize("args", [(1, 2), ("r", "2"), ("r", True)])
def test_invalid_argument_types(call: str, args: tuple[Any, Any]) -> None:
    _, impl = both(WINDOW)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        getattr(impl, call)(*args)
    assert impl.snapshot() == before


# --------------------------------------------------------------------------
# The connector's lookup, boundary states and partial tails
# --------------------------------------------------------------------------


def test_the_connector_lookup_is_the_plain_one_and_never_diverges() -> None:
    model, impl = both((full_attention(2), sliding_window(2, 3)), log_stats=True)
    a = new_request("a", PROMPT, 2)
    model, _ = M.allocate_slots(model, a, 8)
    impl.allocate_slots(a, 8)
    b = new_request("b", [*PROMPT, 2], 2)
    plain = M.get_computed_blocks_with_boundary(model, b)
    model, found = S.get_computed_blocks_for_connector(model, b)
    assert (model, found) == (plain[0], (*plain[1], False))
    blocks, num, boundary, diverged = impl.get_computed_blocks_for_connector(b)
    assert (ids(blocks.get_block_ids()), num, boundary, diverged) == found
    assert impl.snapshot() == model
    assert found[1] == 8


def test_no_group_kvpool_models_offloads_boundary_states_or_partial_tails() -> None:
    model, impl = both(HYBRID_MAMBA, enable_caching=False, hash_block_size=2)
    r = new_request("r", PROMPT, 2)
    model, _ = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    assert S.take_boundary_state_offloads(model) == (model, {})
    assert S.finalize_partial_tail_offloads(model, with_computed(r, 8)) == (model, ())
    assert impl.take_boundary_state_offloads() == {}
    assert impl.finalize_partial_tail_offloads(with_computed(r, 8)) == []


# --------------------------------------------------------------------------
# Zeroing: attention groups beside a Mamba group
# --------------------------------------------------------------------------


def test_attention_blocks_beside_mamba_are_recorded_for_zeroing() -> None:
    model, impl = both(HYBRID_MAMBA, enable_caching=False, hash_block_size=2)
    r = new_request("r", PROMPT, 2)
    model, new = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    assert new == ((1,), (2,))
    assert model.new_block_ids == ((0, 1),)
    assert impl.snapshot() == model
    model, _ = S.record_blocks_for_zeroing(model, "r", 0)
    impl.record_blocks_for_zeroing("r", 0)
    assert impl.snapshot() == model
    model, taken = M.take_new_block_ids(model)
    assert taken == (1, 1) == tuple(impl.take_new_block_ids())


def test_without_mamba_nothing_is_recorded_again() -> None:
    model, impl = both(WINDOW)
    r = new_request("r", PROMPT, 2)
    model, _ = M.allocate_slots(model, r, 8)
    impl.allocate_slots(r, 8)
    assert S.record_blocks_for_zeroing(model, "r", 3)[0] == model
    impl.record_blocks_for_zeroing("r", 3)
    assert impl.snapshot() == model


@pytest.mark.parametrize("start", [-16, 5])
def test_invalid_token_count_zeroing_off_a_block_boundary(start: int) -> None:
    model, impl = both(HYBRID_MAMBA, enable_caching=False, hash_block_size=2)
    before = impl.snapshot()
    with pytest.raises(InvalidTokenCount):
        S.record_blocks_for_zeroing(model, "r", start)
    with pytest.raises(InvalidTokenCount):
        impl.record_blocks_for_zeroing("r", start)
    assert impl.snapshot() == before


# --------------------------------------------------------------------------
# Admission of a whole sequence, and max_in_flight_tokens
# --------------------------------------------------------------------------


def test_a_sequence_that_cannot_fit_is_refused_whole_and_nothing_changes() -> None:
    model, impl = both((full_attention(2),), num_blocks=4)
    r = new_request("r", PROMPT, 2)  # 4 blocks; the pool has 3
    refused = M.allocate_slots(model, r, 2, full_sequence_must_fit=True)
    assert refused == (model, None)
    assert impl.allocate_slots(r, 2, full_sequence_must_fit=True) is None
    assert impl.snapshot() == model
    assert M.allocate_slots(model, r, 2)[1] == ((1,),)  # the first chunk alone fits


def test_a_window_counts_at_most_its_cap_so_a_long_prompt_fits() -> None:
    spec = sliding_window(2, 3)
    model, impl = both((spec,), num_blocks=5, max_in_flight_tokens=2)
    assert max_admission_blocks(spec, 2, 16) == 3
    r = new_request("r", [*PROMPT, *PROMPT[:6]], 2)  # 14 tokens, 7 blocks: capped at 3
    model, new = M.allocate_slots(model, r, 2, full_sequence_must_fit=True)
    assert new == ((1,),)
    assert impl.allocate_slots(r, 2, full_sequence_must_fit=True) is not None
    assert impl.snapshot() == model
    uncapped, uncapped_impl = both((spec,), num_blocks=5, max_in_flight_tokens=16)
    assert M.allocate_slots(uncapped, r, 2, full_sequence_must_fit=True)[1] is None
    assert uncapped_impl.allocate_slots(r, 2, full_sequence_must_fit=True) is None


@pytest.mark.parametrize("value", [0, -3])
def test_invalid_manager_config_in_flight_tokens(value: int) -> None:
    with pytest.raises(InvalidManagerConfig):
        M.new_kv_cache_manager(4, WINDOW, 16, max_in_flight_tokens=value)
    with pytest.raises(InvalidManagerConfig):
        KVCacheManager(KVCacheConfig(4, WINDOW), 16, max_in_flight_tokens=value)


def test_invalid_argument_full_sequence_flag_not_a_bool() -> None:
    _, impl = both(WINDOW)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument):
        impl.allocate_slots(new_request("r", [1, 2], 2), 2, full_sequence_must_fit=1)
    assert impl.snapshot() == before


# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------

CHOSEN = settings(
    settings.get_profile("ci"),
    max_examples=60,
    stateful_step_count=30,
    phases=[Phase.explicit, Phase.generate],
)


@pytest.mark.parametrize("level", [1, 2])
def test_the_impl_conforms_with_every_scheduler_call(level: int) -> None:
    machine = manager_machine(
        ImplManagerTarget, level=level, in_flight=(None, 1, 3), scheduler_calls=True
    )
    run_state_machine_as_test(machine, settings=CHOSEN)


def test_the_impl_conforms_with_every_scheduler_call_and_fine_grained_hits() -> None:
    machine = manager_machine(
        ImplManagerTarget,
        layouts=["full"],
        block_factors=[2],
        fine_grained=[True],
        in_flight=(None, 2),
        scheduler_calls=True,
    )
    run_state_machine_as_test(machine, settings=CHOSEN)


def test_scheduler_call_programs_replay_through_the_scenario_format() -> None:
    base = manager_machine(ModelManagerTarget, in_flight=(None, 2), scheduler_calls=True)

    class Checked(base):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            if self.model is not None:
                line = request_scenarios.record(self.setup, self.script, "machine/program")
                story = request_scenarios.decode(json.loads(line))
                world = request_scenarios.final_state(story)
                assert world.manager == self.model
            super().teardown()

    run_state_machine_as_test(Checked, settings=CHOSEN)
