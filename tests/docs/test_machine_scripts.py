"""The request-level machine keeps each program as request-scenario steps, and the scenario
engine replays them to exactly the machine's state: the hook that lets ``kvpool explain``
tell a request-layer counterexample."""

import json
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvpool.specs.request.machine import manager_machine
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.teaching import request_scenarios


def _replays(machine: Any) -> None:
    """At the end of each program: the script, through the file format, ends where the model is."""
    if machine.model is None:
        return
    line = request_scenarios.record(machine.setup, machine.script, "machine/program")
    story = request_scenarios.decode(json.loads(line))
    world = request_scenarios.final_state(story)
    assert world.manager == machine.model
    live = {rid: r for rid, r in world.requests.items() if not rid.startswith("stranger-")}
    assert live == machine.requests


@pytest.mark.parametrize("level", [1, 2])
def test_every_machine_program_replays_through_the_scenario_format(level: int) -> None:
    base = manager_machine(ModelManagerTarget, level=level)

    class Checked(base):  # type: ignore[misc,valid-type]
        def teardown(self) -> None:
            _replays(self)
            super().teardown()

    chosen = settings(
        settings.get_profile("ci"),
        max_examples=60,
        stateful_step_count=30,
        phases=[Phase.explicit, Phase.generate],
    )
    run_state_machine_as_test(Checked, settings=chosen)
