"""The pool and request machines swarm gently: a program disables few of its rules.

``kvpool.specs.runner.swarm`` reaches into Hypothesis's private swarm; these
tests fail if that reach stops working (a Hypothesis upgrade), instead of the
default profile silently going back to finding fewer bugs.
"""

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis._settings import local_settings
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.strategies._internal.featureflags import FeatureStrategy

from kvpool.specs.pool.machine import pool_machine
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.runner.swarm import _P_DISABLED, MAX_DISABLED, _GentleFeatures


def _features(machine: RuleBasedStateMachine) -> Any:
    shared: Any = machine._rules_strategy.enabled_rules_strategy
    return shared.base


def _machines() -> tuple[RuleBasedStateMachine, ...]:
    return pool_machine(ModelTarget)(), manager_machine(ModelManagerTarget)()


def test_pool_and_request_machines_use_the_gentle_swarm() -> None:
    with local_settings(settings(derandomize=False)):
        for machine in _machines():
            assert isinstance(_features(machine), _GentleFeatures), type(machine).__name__


def test_a_derandomized_run_keeps_hypothesis_swarm() -> None:
    """CI's fixed sample of programs (tests/corpus) is drawn with Hypothesis's own swarm."""
    with local_settings(settings(derandomize=True)):
        for machine in _machines():
            features = _features(machine)
            assert isinstance(features, FeatureStrategy), type(machine).__name__
            assert not isinstance(features, _GentleFeatures), type(machine).__name__


@settings(max_examples=50, database=None)
@given(st.data())
def test_a_program_disables_each_rule_with_a_chance_of_at_most_max_disabled(
    data: st.DataObject,
) -> None:
    flags = data.draw(_GentleFeatures(at_least_one_of={"a", "b"}))
    chance = getattr(flags, _P_DISABLED)
    assert 0 <= chance <= MAX_DISABLED
