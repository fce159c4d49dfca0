"""specs/scenarios.py: the built-in stories are valid, keep every invariant, and round-trip."""

import json
from pathlib import Path

import pytest

from kvpool.model import KVCacheEvent
from kvpool.specs import vectors
from kvpool.specs.pool.invariants import FreeHistory, check_all
from kvpool.specs.teaching import scenarios
from kvpool.specs.teaching.scenarios import ScenarioError

BUILT_IN = list(scenarios.BUILT_IN.values())


@pytest.mark.parametrize("scenario", BUILT_IN, ids=[s.name for s in BUILT_IN])
def test_every_step_is_valid_narrated_and_keeps_the_invariants(
    scenario: scenarios.Scenario,
) -> None:
    assert scenario.title and scenario.summary
    state = scenarios.initial_state(scenario)
    history = FreeHistory.start(state)
    taken: list[KVCacheEvent] = []
    for outcome in scenarios.run(scenario):
        assert outcome.error is None, f"step {outcome.index} is rejected: {outcome.error}"
        assert outcome.step.say.endswith("."), f"step {outcome.index} has no narration"
        assert outcome.before == state
        freed = outcome.step.args.get("block_ids", []) if outcome.step.op == "free_blocks" else []
        history = history.observe(state, outcome.state, freed)
        if outcome.step.op == "take_events":
            taken.extend(state.pending_events)
        state = outcome.state
        check_all(state, history, taken)


def test_the_tutorial_has_ten_steps_and_ends_in_eviction() -> None:
    tutorial = scenarios.get("tutorial")
    assert len(tutorial.steps) == 10
    last = list(scenarios.run(tutorial))[-1]
    assert last.step.op == "get_new_blocks" and last.state.free_queue == ()
    assert (b"ABC", 0) not in last.state.cached


def test_the_classic_surprises_show_what_they_claim() -> None:
    hit = list(scenarios.run(scenarios.get("hit-on-eviction-candidate")))
    assert hit[3].result == [2] and 2 in hit[3].state.free_queue
    dup = list(scenarios.run(scenarios.get("duplicates")))
    assert dup[3].state.cached[(b"A", 0)] == (1, 2) and dup[4].result == [1]
    reset = list(scenarios.run(scenarios.get("reset-refused")))
    assert reset[2].result is False and reset[4].result is True
    partial = list(scenarios.run(scenarios.get("partial-promoted")))
    assert partial[1].state.cached == {(b"AB", 0): (1,)}
    assert partial[3].state.cached == {(b"ABCD", 0): (1,)}
    first = scenarios.final_state(scenarios.get("hashless-first"))
    append = scenarios.final_state(scenarios.get("hashless-first-under-append"))
    assert set(first.cached) == {(b"A", 0), (b"AB", 0)} and not append.cached


def test_with_profile_changes_only_the_profile() -> None:
    scenario = scenarios.get("hashless-first")
    other = scenario.with_profile("append")
    assert other.steps == scenario.steps
    assert other.config.profile.name == "append"
    assert other.config.num_blocks == scenario.config.num_blocks
    assert other.name == "hashless-first@append"


def _as_vector(scenario: scenarios.Scenario, vector_id: str) -> dict[str, object]:
    calls = [(s.op, dict(s.args)) for s in scenario.steps]
    return vectors.vector_from_calls(scenario.config, calls, vector_id, scenario.title)


def test_a_scenario_exported_as_a_vector_reads_back_the_same(tmp_path: Path) -> None:
    scenario = scenarios.get("duplicates")
    file = tmp_path / "one.jsonl"
    file.write_text(vectors.dump_line(_as_vector(scenario, "story/duplicates")) + "\n")
    loaded = scenarios.load(file)
    assert loaded.name == "story/duplicates"
    assert [s.op for s in loaded.steps] == [s.op for s in scenario.steps]
    outcomes = list(scenarios.run(loaded))
    assert all(o.mismatch is None for o in outcomes)
    assert outcomes[-1].state == scenarios.final_state(scenario)


def test_a_file_of_several_vectors_needs_an_id(tmp_path: Path) -> None:
    file = tmp_path / "two.jsonl"
    lines = [
        vectors.dump_line(_as_vector(scenarios.get(name), f"story/{name}"))
        for name in ("tutorial", "reset-refused")
    ]
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(ScenarioError, match="holds 2 vectors"):
        scenarios.load(file)
    assert scenarios.load(file, "story/reset-refused").name == "story/reset-refused"
    with pytest.raises(ScenarioError, match="no vector with id"):
        scenarios.load(file, "story/nothing")


def test_a_vector_the_model_now_answers_differently_is_flagged(tmp_path: Path) -> None:
    data = _as_vector(scenarios.get("tutorial"), "story/tampered")
    steps = data["steps"]
    assert isinstance(steps, list)
    steps[0]["expect"] = {"ok": [4, 3, 2, 1]}
    file = tmp_path / "tampered.jsonl"
    file.write_text(json.dumps(data) + "\n")
    outcomes = list(scenarios.run(scenarios.load(file)))
    assert outcomes[0].mismatch is not None and "[4, 3, 2, 1]" in outcomes[0].mismatch
    assert all(o.mismatch is None for o in outcomes[1:])


def test_bad_vector_files_and_unknown_names_are_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ScenarioError):
        scenarios.resolve(str(bad))
    with pytest.raises(ScenarioError, match="built-in"):
        scenarios.resolve("no-such-scenario")
    with pytest.raises(ScenarioError, match="tutorial"):
        scenarios.get("no-such-scenario")


def test_bundled_vector_ids_resolve() -> None:
    scenario = scenarios.resolve("eviction/under-pressure")
    assert scenario.steps and scenario.expected
    assert all(o.mismatch is None for o in scenarios.run(scenario))


def test_rejected_steps_leave_the_state_and_go_on() -> None:
    scenario = scenarios.resolve("rejections/counts-and-ids")
    outcomes = list(scenarios.run(scenario))
    rejected = [o for o in outcomes if o.error is not None]
    assert rejected and all(o.state == o.before for o in rejected)
    assert all(o.mismatch is None for o in outcomes)
