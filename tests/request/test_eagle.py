"""EAGLE on several KV cache groups and multi-module MTP's look-ahead (``kvpool.model.eagle``),
in the model and the impl alike."""

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.impl.manager import KVCacheConfig, KVCacheManager
from kvpool.model import manager as model_manager
from kvpool.model.eagle import group_flags
from kvpool.model.errors import InvalidManagerConfig
from kvpool.model.request import new_request
from kvpool.model.single_type import KVCacheSpec, chunked_local, full_attention, sliding_window
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.targets.impl.request import ImplManagerTarget
from kvpool.specs.teaching import request_scenarios

Build = Callable[..., object]


def _model(num_blocks: int, specs: list[KVCacheSpec], **kwargs: Any) -> object:
    return model_manager.new_kv_cache_manager(num_blocks, specs, 32, **kwargs)


def _impl(num_blocks: int, specs: list[KVCacheSpec], **kwargs: Any) -> object:
    fine = kwargs.pop("fine_grained_hits", False)
    if "enable_events" in kwargs:
        kwargs["enable_kv_cache_events"] = kwargs.pop("enable_events")
    return KVCacheManager(
        KVCacheConfig(num_blocks, tuple(specs)), 32, fine_grained_hits=fine, **kwargs
    )


BOTH = pytest.mark.parametrize("build", [_model, _impl], ids=["model", "impl"])


# --------------------------------------------------------------------------
# The constructor's preconditions
# --------------------------------------------------------------------------


@BOTH
def test_invalid_negative_lookahead(build: Build) -> None:
    with pytest.raises(InvalidManagerConfig, match="negative"):
        build(8, [full_attention(4)], num_prefill_lookahead=-1)


@BOTH
@pytest.mark.parametrize("value", [1.0, True, "2", None])
def test_invalid_lookahead_that_is_not_an_int(build: Build, value: object) -> None:
    with pytest.raises(InvalidManagerConfig, match="must be an int"):
        build(8, [full_attention(4)], num_prefill_lookahead=value)


@BOTH
def test_invalid_lookahead_past_a_scheduler_block_with_eagle(build: Build) -> None:
    with pytest.raises(InvalidManagerConfig, match="scheduler_block_size=4"):
        build(8, [full_attention(4), sliding_window(4, 4)], use_eagle=True, num_prefill_lookahead=5)
    # a block's worth is allowed, and so is any look-ahead without EAGLE or without caching
    build(8, [full_attention(4)], use_eagle=True, num_prefill_lookahead=4)
    build(8, [full_attention(4)], num_prefill_lookahead=5)
    build(8, [full_attention(4)], use_eagle=True, num_prefill_lookahead=5, enable_caching=False)


@BOTH
def test_invalid_eagle_with_a_chunked_local_group_and_caching(build: Build) -> None:
    with pytest.raises(InvalidManagerConfig, match="chunked-local"):
        build(8, [full_attention(4), chunked_local(4, 8)], use_eagle=True)
    build(8, [full_attention(4), chunked_local(4, 8)], use_eagle=True, enable_caching=False)


class FullAttentionSpec:
    """Stands in for vLLM's spec class of that name (the impl reads specs by class name)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size


class Group:
    def __init__(self, block_size: int, is_eagle_group: bool) -> None:
        self.kv_cache_spec = FullAttentionSpec(block_size)
        self.is_eagle_group = is_eagle_group


class Config:
    def __init__(self, *flags: bool, block_size: int = 4) -> None:
        self.num_blocks = 8
        self.kv_cache_groups = [Group(block_size, flag) for flag in flags]


def test_eagle_flagged_on_one_of_two_equal_groups_runs_on_both() -> None:
    # groups of one spec are searched together: the flag is their spec's (vLLM 0.33)
    manager = KVCacheManager(Config(False, True), 32, use_eagle=True)
    assert [m.use_eagle for m in manager.managers] == [True, True]
    assert manager.snapshot().config.eagle_groups == (1,)
    # flags without use_eagle drop nothing
    manager = KVCacheManager(Config(False, True), 32, num_prefill_lookahead=4)
    assert [m.use_eagle for m in manager.managers] == [False, False]


def test_eagle_flagged_on_some_groups_runs_on_their_specs_only() -> None:
    model = model_manager.new_kv_cache_manager(
        16, [full_attention(4), sliding_window(4, 4)], 32, use_eagle=True, eagle_groups=[1]
    )
    assert group_flags(model.managers.specs, True, model.config.eagle_groups) == (False, True)
    impl = KVCacheManager(
        KVCacheConfig(16, (full_attention(4), sliding_window(4, 4)), eagle_groups=(1,)),
        32,
        use_eagle=True,
    )
    assert [m.use_eagle for m in impl.managers] == [False, True]
    assert impl.snapshot() == model


@pytest.mark.parametrize("groups", [[2], [-1], [0, 0]])
def test_invalid_eagle_groups_not_groups(groups: list[int]) -> None:
    specs = [full_attention(4), sliding_window(4, 4)]
    with pytest.raises(InvalidManagerConfig, match="eagle_groups"):
        model_manager.new_kv_cache_manager(16, specs, 32, use_eagle=True, eagle_groups=groups)
    with pytest.raises(InvalidManagerConfig, match="eagle_groups"):
        KVCacheManager(
            KVCacheConfig(16, tuple(specs), eagle_groups=tuple(groups)), 32, use_eagle=True
        )


def test_invalid_lookahead_past_a_scheduler_block_with_flagged_groups() -> None:
    """vLLM 0.33 checks the look-ahead against the block when any group is flagged, even
    with use_eagle off (KVCacheCoordinator.__init__)."""
    with pytest.raises(InvalidManagerConfig, match="num_prefill_lookahead=5"):
        KVCacheManager(Config(False, True), 32, num_prefill_lookahead=5)
    KVCacheManager(Config(False, True), 32, num_prefill_lookahead=5, enable_caching=False)


# --------------------------------------------------------------------------
# The hybrid search and what is cached
# --------------------------------------------------------------------------


def _targets(setup: ManagerSetup) -> list[Any]:
    return [ModelManagerTarget(setup), ImplManagerTarget(setup)]


def test_an_eagle_hybrid_search_peeks_one_block_past_the_candidate() -> None:
    """Full attention drops its sixth block (20 tokens); the window then looks up to 24
    tokens, finds blocks 4 and 5 (its run of two, the EAGLE one included) and drops 5: the
    hit stays at 20 tokens. Without the peek the window would find 3 and 4 and cut it to 16.
    The shape of vLLM 0.33's test_prefill_hybrid_model_eagle."""
    setup = ManagerSetup(16, (full_attention(4), sliding_window(4, 5)), 32, 4, use_eagle=True)
    first = new_request("a", tuple(range(1, 28)), 4)  # 6 full blocks and 3 tokens
    later = new_request("b", tuple(range(1, 26)), 4)  # the same 6 blocks and 1 token
    for target in _targets(setup):
        assert target.allocate_slots(first, 27) == ((1, 2, 3, 4, 5, 6, 7), tuple(range(8, 15)))
        assert target.get_computed_blocks(later) == (((1, 2, 3, 4, 5), (0, 0, 0, 0, 12)), 20)


@pytest.mark.parametrize(
    ("specs", "eagle", "lookahead", "cached"),
    [
        ((full_attention(4),), True, 3, 1),  # one group: 8 - 2 re-prefillable tokens
        ((full_attention(4),), False, 3, 1),  # ... with EAGLE or not
        ((full_attention(4),), True, 1, 2),  # a look-ahead of 1 re-prefills nothing
        ((full_attention(4), full_attention(4)), True, 3, 1),  # EAGLE groups of a hybrid
        ((full_attention(4), full_attention(4)), False, 3, 2),  # no EAGLE group: all cached
    ],
)
def test_tokens_multi_module_mtp_prefills_again_are_not_cached(
    specs: tuple[KVCacheSpec, ...], eagle: bool, lookahead: int, cached: int
) -> None:
    setup = ManagerSetup(16, specs, 32, 4, use_eagle=eagle, num_prefill_lookahead=lookahead)
    request = new_request("a", tuple(range(1, 10)), 4)
    for target in _targets(setup):
        target.allocate_slots(request, 8)
        state = target.snapshot()
        assert [t.num_cached_block["a"] for t in state.managers.tables] == [cached] * len(specs)


# --------------------------------------------------------------------------
# In lock step
# --------------------------------------------------------------------------


def test_the_impl_conforms_with_eagle_hybrids_and_lookaheads() -> None:
    machine = manager_machine(
        ImplManagerTarget,
        layouts=["full", "full+sliding_window", "full+sliding_window+sliding_window"],
        prefill_lookaheads=(0, 1, 2, 3),
        eagle_hybrids=True,
    )
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=120,
        stateful_step_count=40,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    )
    run_state_machine_as_test(machine, settings=chosen)


FLAGGED_LAYOUTS = [
    "full+sliding_window",
    "full+full+sliding_window",
    "wide_full+sliding_window+sliding_window",
]


def test_the_impl_conforms_with_eagle_flagged_on_some_groups() -> None:
    machine = manager_machine(
        ImplManagerTarget,
        layouts=FLAGGED_LAYOUTS,
        prefill_lookaheads=(0, 1, 2),
        eagle_hybrids=True,
        eagle_flags=True,
    )
    chosen = settings(
        settings.get_profile("ci"),
        max_examples=80,
        stateful_step_count=30,
        phases=[Phase.explicit, Phase.generate],
    )
    run_state_machine_as_test(machine, settings=chosen)


def test_eagle_flag_programs_replay_through_the_scenario_format() -> None:
    base = manager_machine(
        ModelManagerTarget, layouts=FLAGGED_LAYOUTS, eagle_hybrids=True, eagle_flags=True
    )
    flagged: list[tuple[int, ...]] = []

    class Checked(base):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            if self.model is not None:
                flagged.append(self.setup.eagle_groups)
                line = request_scenarios.record(self.setup, self.script, "machine/program")
                story = request_scenarios.decode(json.loads(line))
                assert story.setup.eagle_groups == self.setup.eagle_groups
                world = request_scenarios.final_state(story)
                assert world.manager == self.model
            super().teardown()

    chosen = settings(
        settings.get_profile("ci"), max_examples=40, phases=[Phase.explicit, Phase.generate]
    )
    run_state_machine_as_test(Checked, settings=chosen)
    assert any(flagged), "no program flagged a group"
