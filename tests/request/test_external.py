"""A KV connector's loads at admission (``kvpool.model.external``): external tokens, reserved
blocks, groups whose loaded blocks are not zeroed; the model, and the impl beside it."""

import json
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl import KVCacheConfig, KVCacheManager
from kvpool.model import manager as M
from kvpool.model.errors import (
    HitOnRunningRequest,
    InvalidArgument,
    InvalidTokenCount,
    NoNewTokens,
    UnknownGroup,
)
from kvpool.model.request import new_request, with_computed
from kvpool.model.single_type import KVCacheSpec, full_attention, mamba, sliding_window
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.targets.impl.request import ImplManagerTarget
from kvpool.specs.teaching import request_scenarios


def both(num_blocks: int, *specs: KVCacheSpec, **kw: Any) -> tuple[M.KVCacheManagerState, Any]:
    model = M.new_kv_cache_manager(num_blocks, specs, max_model_len=64, **kw)
    impl = KVCacheManager(KVCacheConfig(num_blocks, specs), max_model_len=64, **kw)
    return model, impl


def impl_ids(blocks: Any) -> Any:
    return None if blocks is None else tuple(tuple(g) for g in blocks.get_block_ids())


# --------------------------------------------------------------------------
# reserved_blocks
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("reserved", "fits"), [(4, True), (6, True), (7, False), (10, False)])
def test_reserved_blocks_must_stay_free_after_the_step(reserved: int, fits: bool) -> None:
    # 10 usable blocks; the step takes 4 of them, the whole 128-token request 8
    model, impl = both(11, full_attention(16))
    request = new_request("r", list(range(128)), 16)
    kw = {"full_sequence_must_fit": True, "reserved_blocks": reserved}
    after, blocks = M.allocate_slots(model, request, 64, **kw)  # type: ignore[arg-type]
    assert (blocks is not None) is fits
    if not fits:
        assert after == model
    assert impl_ids(impl.allocate_slots(request, 64, **kw)) == blocks
    assert impl.snapshot() == after


def test_full_sequence_admission_ignores_the_reservation() -> None:
    # the whole sequence needs every free block; the reservation is left out of that check
    model, _ = both(5, full_attention(4))
    request = new_request("r", list(range(16)), 4)
    _, blocks = M.allocate_slots(model, request, 4, full_sequence_must_fit=True, reserved_blocks=3)
    assert blocks == ((1,),)


def test_invalid_negative_reserved_blocks() -> None:
    model, impl = both(8, full_attention(2))
    request = new_request("r", [1, 2, 3], 2)
    with pytest.raises(InvalidTokenCount, match="reserved_blocks"):
        M.allocate_slots(model, request, 3, reserved_blocks=-1)
    before = impl.snapshot()
    with pytest.raises(InvalidTokenCount, match="reserved_blocks"):
        impl.allocate_slots(request, 3, reserved_blocks=-1)
    assert impl.snapshot() == before == model


# --------------------------------------------------------------------------
# external tokens
# --------------------------------------------------------------------------


def test_external_tokens_get_blocks_of_their_own_and_are_cached_once_computed() -> None:
    model, impl = both(16, full_attention(4))
    request = new_request("r", list(range(14)), 4)
    state, blocks = M.allocate_slots(model, request, 2, num_external_computed_tokens=12)
    # the step's own blocks only: the external tokens' three come first
    assert blocks == ((4,),)
    assert M.get_block_ids(state, "r") == ((1, 2, 3, 4),)
    assert impl_ids(impl.allocate_slots(request, 2, num_external_computed_tokens=12)) == blocks
    assert impl.snapshot() == state
    # cached: another request hits the loaded blocks
    other = new_request("o", list(range(14)), 4)
    _, (hit, num_hit) = M.get_computed_blocks(state, other)
    assert (hit, num_hit) == (((1, 2, 3),), 12)


def test_an_async_load_allocates_with_no_new_tokens_and_caches_nothing_yet() -> None:
    model, impl = both(16, full_attention(4))
    request = new_request("r", list(range(14)), 4)
    kw: dict[str, Any] = {"num_external_computed_tokens": 12, "delay_cache_blocks": True}
    state, blocks = M.allocate_slots(model, request, 0, **kw)
    assert blocks == ((),) and M.get_block_ids(state, "r") == ((1, 2, 3),)
    assert impl_ids(impl.allocate_slots(request, 0, **kw)) == blocks
    assert impl.snapshot() == state
    _, (_, num_hit) = M.get_computed_blocks(state, new_request("o", list(range(14)), 4))
    assert num_hit == 0
    # the load done, the next step caches them
    state, _ = M.allocate_slots(state, with_computed(request, 12), 2)
    _, (_, num_hit) = M.get_computed_blocks(state, new_request("o", list(range(14)), 4))
    assert num_hit == 12


def test_a_group_takes_every_hit_before_any_group_loads() -> None:
    # full attention + sliding window: hits free in the queue's head must not be handed
    # out again for the other group's external blocks (vLLM's issue #33775)
    model, impl = both(24, full_attention(4), sliding_window(4, 8))
    warm = new_request("w", list(range(33)), 4)
    model, _ = M.allocate_slots(model, warm, 33)
    impl.allocate_slots(warm, 33)
    model, _ = M.free(model, "w")
    impl.free(warm)
    request = new_request("r", list(range(40)), 4)
    model, (hit, num_hit) = M.get_computed_blocks(model, request)
    impl_hit, impl_num, _ = impl.get_computed_blocks(request)
    assert num_hit == impl_num == 32
    state, blocks = M.allocate_slots(
        model, request, 4, num_hit, hit, num_external_computed_tokens=4
    )
    assert (
        impl_ids(
            impl.allocate_slots(request, 4, impl_num, impl_hit, num_external_computed_tokens=4)
        )
        == blocks
    )
    assert impl.snapshot() == state
    tables = M.get_block_ids(state, "r")
    real = [b for g in tables for b in g if b != 0]
    assert len(real) == len(set(real))
    # the window's table starts with nulls where the external tokens put it out of reach
    assert tables[1][:7] == (0,) * 7


def test_skip_zeroing_group_ids_names_groups_that_exist() -> None:
    model, impl = both(16, full_attention(4), full_attention(4))
    request = new_request("r", list(range(14)), 4)
    state, _ = M.allocate_slots(
        model, request, 2, num_external_computed_tokens=8, skip_zeroing_group_ids=(1,)
    )
    # every group's external blocks first, then every group's new ones
    assert M.get_block_ids(state, "r") == ((1, 2, 5), (3, 4, 6))
    impl.allocate_slots(request, 2, num_external_computed_tokens=8, skip_zeroing_group_ids=(1,))
    assert impl.snapshot() == state


INVALID: list[tuple[str, type[Exception], dict[str, Any], bool]] = [
    ("negative_external_tokens", InvalidTokenCount, {"num_external_computed_tokens": -1}, False),
    (
        "external_tokens_past_the_request",
        InvalidTokenCount,
        {"num_external_computed_tokens": 13},
        False,
    ),
    ("external_tokens_on_a_running_request", HitOnRunningRequest, {}, True),
    ("unknown_group_not_to_zero", UnknownGroup, {"skip_zeroing_group_ids": (1,)}, False),
    ("no_new_tokens_without_external", NoNewTokens, {"num_new_tokens": 0}, False),
]


@pytest.mark.parametrize(("reason", "error", "kw", "running"), INVALID, ids=[i[0] for i in INVALID])
def test_invalid(reason: str, error: type[Exception], kw: dict[str, Any], running: bool) -> None:
    model, impl = both(16, full_attention(4))
    request = new_request("r", list(range(12)), 4)
    if running:
        model, _ = M.allocate_slots(model, request, 4)
        impl.allocate_slots(request, 4)
        request = with_computed(request, 4)
        kw = {"num_external_computed_tokens": 4}
    args = {"num_new_tokens": 1, **kw}
    with pytest.raises(error):
        M.allocate_slots(model, request, **args)
    before = impl.snapshot()
    assert before == model
    with pytest.raises(error):
        impl.allocate_slots(request, **args)
    assert impl.snapshot() == before


def test_invalid_external_tokens_beside_a_mamba_group() -> None:
    model, impl = both(16, full_attention(4), mamba(64), enable_caching=False)
    request = new_request("r", list(range(12)), 4)
    with pytest.raises(InvalidArgument, match="Mamba"):
        M.allocate_slots(model, request, 1, num_external_computed_tokens=4)
    before = impl.snapshot()
    with pytest.raises(InvalidArgument, match="Mamba"):
        impl.allocate_slots(request, 1, num_external_computed_tokens=4)
    assert impl.snapshot() == before == model


# --------------------------------------------------------------------------
# The machine: the impl in lock-step, programs through the scenario format
# --------------------------------------------------------------------------

CHOSEN = settings(
    settings.get_profile("ci"),
    max_examples=60,
    stateful_step_count=30,
    phases=[Phase.explicit, Phase.generate],
)
CONNECTOR_LAYOUTS = ["full", "sliding_window", "chunked_local", "full+sliding_window"]


@pytest.mark.parametrize("level", [1, 2])
def test_the_impl_conforms_with_a_connector_s_loads(level: int) -> None:
    machine = manager_machine(
        ImplManagerTarget,
        layouts=CONNECTOR_LAYOUTS,
        level=level,
        in_flight=(None, 1, 3),
        scheduler_calls=True,
        connector_loads=True,
    )
    run_state_machine_as_test(machine, settings=CHOSEN)


def test_connector_load_programs_replay_through_the_scenario_format() -> None:
    base = manager_machine(
        ModelManagerTarget,
        layouts=CONNECTOR_LAYOUTS,
        in_flight=(None, 2),
        scheduler_calls=True,
        connector_loads=True,
    )
    loads: list[int] = []

    class Checked(base):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            if self.model is not None:
                loads.append(
                    sum(
                        1
                        for op, args in self.script
                        if op == "allocate_slots" and "num_external_computed_tokens" in args
                    )
                )
                line = request_scenarios.record(self.setup, self.script, "machine/program")
                story = request_scenarios.decode(json.loads(line))
                world = request_scenarios.final_state(story)
                assert world.manager == self.model
            super().teardown()

    run_state_machine_as_test(Checked, settings=CHOSEN)
    assert sum(loads) > 0, "no program loaded external tokens"
