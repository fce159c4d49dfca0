"""specs/teaching/request_*: the request-layer stories are valid, keep the invariants, show
what they claim, and round-trip through the scenario file format; the facts the pictures
and texts read agree with the model's own answers."""

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.model import manager as mm
from kvpool.model.single_type import full_attention
from kvpool.specs.pool.invariants import check_all
from kvpool.specs.request.invariants import ref_counts_match_tables
from kvpool.specs.teaching import request_facts as facts
from kvpool.specs.teaching import request_figures, request_scenarios, request_stories
from kvpool.specs.teaching.request_scenarios import RequestScenario, World
from kvpool.specs.teaching.scenarios import ScenarioError, Step

STORIES = list(request_stories.BUILT_IN.values())
OUTCOMES = [(s.name, o) for s in STORIES for o in request_scenarios.run(s)]


def _tables(world: World) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {
        rid: mm.get_block_ids(world.manager, rid) for rid in mm.running_request_ids(world.manager)
    }


def test_there_are_at_least_eight_request_layer_stories() -> None:
    assert len(STORIES) >= 8
    assert not set(request_stories.BUILT_IN) & set(
        __import__("kvpool.specs.teaching.scenarios", fromlist=["BUILT_IN"]).BUILT_IN
    ), "a name must say which layer it is"


@pytest.mark.parametrize("story", STORIES, ids=[s.name for s in STORIES])
def test_every_step_is_valid_narrated_and_keeps_the_invariants(story: RequestScenario) -> None:
    assert story.title and story.summary
    world = request_scenarios.initial_state(story)
    for outcome in request_scenarios.run(story):
        assert outcome.error is None, f"step {outcome.index} is rejected: {outcome.error}"
        assert outcome.step.say.endswith("."), f"step {outcome.index} has no narration"
        assert outcome.before == world
        world = outcome.state
        check_all(world.pool, None, None)
        assert ref_counts_match_tables(world.pool, _tables(world)) is None
        assert facts.describe(outcome)


def _step(name: str, index: int) -> request_scenarios.Outcome:
    return list(request_scenarios.run(request_stories.get(name)))[index - 1]


def test_the_stories_show_what_they_claim() -> None:
    assert _step("hit-stops-one-short", 4).result == {"blocks": [[1]], "num_tokens": 2}
    assert _step("hit-stops-one-short", 5).state.pool.cached[
        (_step("hit-stops-one-short", 5).state.requests["b"].block_hashes[1], 0)
    ] == (2, 3)
    assert _step("sliding-window-hit", 6).result == {"blocks": [[0, 0, 0, 4, 5]], "num_tokens": 10}
    assert _step("chunked-local-hit", 7).result == {"blocks": [[0, 0, 0, 0]], "num_tokens": 8}
    assert not request_scenarios.final_state(request_stories.get("mamba-state")).pool.cached
    assert _step("hybrid-hit", 6).result == {"blocks": [[1, 2, 3], [0, 7, 8]], "num_tokens": 6}
    refused = _step("admission", 8)
    assert refused.result is None and refused.state == refused.before
    assert _step("admission", 9).result == [[6]]
    slide = _step("window-slides", 6)
    assert slide.result is None and slide.state != slide.before
    assert mm.get_block_ids(slide.state.manager, "a") == ((0, 0, 3, 4),)
    assert _step("free-order", 3).state.pool.free_queue == (8, 4, 9, 10, 11, 3, 2, 1, 7, 6, 5)
    assert _step("preempt-resume", 5).result == {"blocks": [[1, 2, 3]], "num_tokens": 6}
    assert request_scenarios.final_state(request_stories.get("request-life")).pool.free_queue == (
        4,
        6,
        7,
        3,
        5,
        2,
        1,
    )
    lookups = [o for o in request_scenarios.run(request_stories.get("hash-chain"))]
    hits = {
        o.step.args["request_id"]: o.result["num_tokens"]
        for o in lookups
        if o.step.op == "get_computed_blocks"
    }
    assert hits == {"b": 0, "c": 0, "d": 2, "e": 2, "f": 4}


@pytest.mark.parametrize(
    ("name", "outcome"),
    [(n, o) for n, o in OUTCOMES if o.step.op == "allocate_slots"],
    ids=[f"{n}-{o.index}" for n, o in OUTCOMES if o.step.op == "allocate_slots"],
)
def test_the_admission_facts_predict_the_answer(
    name: str, outcome: request_scenarios.Outcome
) -> None:
    admission = facts.admission(outcome.before, outcome.step.args)
    assert admission.admitted == (outcome.result is not None)
    if outcome.result is not None:
        taken = len(outcome.before.pool.free_queue) - len(outcome.state.pool.free_queue)
        released = sum(len(g.released) for g in admission.groups)
        assert taken == admission.needed - released


@pytest.mark.parametrize(
    ("name", "outcome"),
    [(n, o) for n, o in OUTCOMES if o.step.op == "get_computed_blocks"],
    ids=[f"{n}-{o.index}" for n, o in OUTCOMES if o.step.op == "get_computed_blocks"],
)
def test_the_lookup_facts_and_rounds_agree_with_the_manager(
    name: str, outcome: request_scenarios.Outcome
) -> None:
    rid = str(outcome.step.args["request_id"])
    request = outcome.state.requests[rid]
    blocks, num = outcome.state.lookups[rid]
    rows = facts.hit_rows(outcome.state, request, blocks, num)
    for row, group_hit in zip(rows, blocks, strict=True):
        kinds = [c.kind for c in row.cells[: len(group_hit)]]
        assert all(k in (facts.HIT, facts.SKIPPED) for k in kinds)
        assert [c.block for c in row.cells[: len(group_hit)]] == list(group_hit)
    rounds, length = facts.hybrid_rounds(outcome.before, request)
    assert length == num and rounds


@pytest.mark.parametrize(
    ("name", "outcome"),
    [(n, o) for n, o in OUTCOMES if o.step.op in ("free", "preempt")],
    ids=[f"{n}-{o.index}" for n, o in OUTCOMES if o.step.op in ("free", "preempt")],
)
def test_the_release_facts_match_the_free_queue(
    name: str, outcome: request_scenarios.Outcome
) -> None:
    rid = str(outcome.step.args["request_id"])
    items = facts.release(
        outcome.before.pool, outcome.state.pool, facts.freed_order(outcome.before, rid)
    )
    queue = outcome.state.pool.free_queue
    front = [r.block for r in items if r.where == "front"]
    back = [r.block for r in items if r.where == "back"]
    assert tuple(reversed(front)) == queue[: len(front)]
    assert tuple(back) == queue[len(queue) - len(back) :]
    for r in items:
        if r.where == "held":
            assert outcome.state.pool.blocks[r.block].ref_cnt > 0


def test_the_hybrid_figure_replays_the_managers_search() -> None:
    world, request = request_figures.hybrid_input()
    rounds, length = facts.hybrid_rounds(world, request)
    assert len(rounds) == 2 and [r.length for r in rounds] == [10, 6]
    assert mm.find_hit(world.manager, request.block_hashes, request.num_tokens - 1)[1] == length


def test_with_profile_changes_only_the_profile() -> None:
    story = request_stories.get("request-life")
    other = story.with_profile("append")
    assert other.steps == story.steps and other.setup.profile.name == "append"
    assert other.name == "request-life@append"
    assert request_scenarios.final_state(other).pool.free_queue == (6, 7, 4, 3, 5, 2, 1)


# --------------------------------------------------------------------------
# The file format
# --------------------------------------------------------------------------


def _write(tmp_path: Path, *objects: object) -> Path:
    path = tmp_path / "story.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in objects) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("story", STORIES, ids=[s.name for s in STORIES])
def test_a_story_written_to_a_file_reads_back_the_same(
    story: RequestScenario, tmp_path: Path
) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(request_scenarios.dump_line(story) + "\n", encoding="utf-8")
    assert request_scenarios.is_request_file(path)
    loaded = request_scenarios.load(path)
    assert loaded.name == story.name and loaded.setup == story.setup
    assert [(s.op, dict(s.args), s.say) for s in loaded.steps] == [
        (s.op, dict(s.args), s.say) for s in story.steps
    ]
    outcomes = list(request_scenarios.run(loaded))
    assert all(o.mismatch is None for o in outcomes)
    assert outcomes[-1].state == request_scenarios.final_state(story)


def test_record_is_the_hook_for_recorded_calls() -> None:
    setup = request_scenarios.setup(4, [full_attention(2)], max_model_len=8)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("new_request", {"request_id": "a", "prompt": [1, 2, 3]}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 3}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 0}),
    ]
    data = json.loads(request_scenarios.record(setup, calls, "rec/one", "recorded"))
    assert data["layer"] == "request" and data["id"] == "rec/one"
    assert [s["expect"] for s in data["steps"][1:]] == [{"ok": [[1, 2]]}, {"error": "NoNewTokens"}]
    story = request_scenarios.decode(data)
    outcomes = list(request_scenarios.run(story))
    assert outcomes[2].error == "NoNewTokens" and outcomes[2].state == outcomes[2].before


def test_an_answer_the_model_no_longer_gives_is_flagged(tmp_path: Path) -> None:
    data = request_scenarios.encode(request_stories.get("admission"))
    steps = data["steps"]
    assert isinstance(steps, list)
    steps[7]["expect"] = {"ok": [[9]]}
    outcomes = list(request_scenarios.run(request_scenarios.load(_write(tmp_path, data))))
    assert outcomes[7].mismatch is not None and "[[9]]" in outcomes[7].mismatch
    assert all(o.mismatch is None for i, o in enumerate(outcomes) if i != 7)


def _minimal(**changes: object) -> dict[str, object]:
    setup = request_scenarios.setup(4, [full_attention(2)], max_model_len=8)
    data: dict[str, object] = {
        "layer": "request",
        "format_version": 1,
        "id": "x",
        "config": request_scenarios.encode_setup(setup),
        "steps": [{"op": "new_request", "args": {"request_id": "a", "prompt": [1, 2]}}],
    }
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layer": "pool"}, "not a request-layer scenario"),
        ({"format_version": 2}, "format_version"),
        ({"extra": 1}, "unknown field"),
        ({"steps": [{"op": "fly", "args": {}}]}, "unknown operation"),
        ({"steps": [{"op": "free", "args": {"request_id": "a"}}]}, "not live"),
        ({"steps": [{"op": "free", "args": {"request_id": "a", "x": 1}}]}, "unknown argument"),
        ({"steps": [{"op": "new_request", "args": {"request_id": "a", "prompt": "AB"}}]}, "prompt"),
        (
            {
                "steps": [
                    {"op": "new_request", "args": {"request_id": "a", "prompt": [1]}},
                    {
                        "op": "allocate_slots",
                        "args": {
                            "request_id": "a",
                            "num_new_tokens": 1,
                            "new_computed_blocks": "lookup",
                        },
                    },
                ]
            },
            "never made",
        ),
        ({"steps": [{"op": "usage", "args": {}, "expect": {"ok": 1, "error": "X"}}]}, "expect"),
        ({"config": {"num_blocks": 4}}, "missing field"),
        (
            {
                "config": {
                    **request_scenarios.encode_setup(
                        request_scenarios.setup(4, [full_attention(2)])
                    ),
                    "num_blocks": 99999,
                }
            },
            "num_blocks",
        ),
        (
            {
                "config": {
                    **request_scenarios.encode_setup(
                        request_scenarios.setup(4, [full_attention(3)])
                    )
                }
            },
            "cannot build",
        ),
        (
            {
                "config": {
                    **request_scenarios.encode_setup(
                        request_scenarios.setup(4, [full_attention(2)])
                    ),
                    "profile": "nope",
                }
            },
            "profile",
        ),
        (
            {
                "config": {
                    **request_scenarios.encode_setup(
                        request_scenarios.setup(4, [full_attention(2)])
                    ),
                    "groups": [{"attention": "linear"}],
                }
            },
            "attention",
        ),
        (
            {"steps": [{"op": "new_request", "args": {"request_id": "a", "prompt": [1] * 70000}}]},
            "at most",
        ),
    ],
)
def test_a_bad_file_is_a_scenario_error_naming_what_is_wrong(
    changes: dict[str, object], message: str, tmp_path: Path
) -> None:
    with pytest.raises(ScenarioError, match=message):
        request_scenarios.load(_write(tmp_path, _minimal(**changes)))


def test_several_scenarios_in_a_file_need_an_id(tmp_path: Path) -> None:
    path = _write(tmp_path, _minimal(id="one"), _minimal(id="two"))
    with pytest.raises(ScenarioError, match="holds 2 scenarios"):
        request_scenarios.load(path)
    assert request_scenarios.load(path, "two").name == "two"
    with pytest.raises(ScenarioError, match="no scenario with id"):
        request_scenarios.load(path, "three")


def test_files_that_are_not_request_scenarios(tmp_path: Path) -> None:
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n", encoding="utf-8")
    assert not request_scenarios.is_request_file(junk)
    with pytest.raises(ScenarioError, match="not JSON"):
        request_scenarios.load(junk)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="no scenario"):
        request_scenarios.load(empty)
    assert not request_scenarios.is_request_file(tmp_path / "missing.jsonl")


def test_a_rejected_step_leaves_the_world_and_the_run_goes_on() -> None:
    setup = request_scenarios.setup(4, [full_attention(2)], max_model_len=8)
    story = RequestScenario(
        "s",
        "rejections",
        setup,
        (
            Step("new_request", {"request_id": "a", "prompt": []}),
            Step("new_request", {"request_id": "b", "prompt": [1, 2, 3]}),
            Step("allocate_slots", {"request_id": "b", "num_new_tokens": -1}),
            Step("allocate_slots", {"request_id": "b", "num_new_tokens": 3}),
        ),
    )
    outcomes = list(request_scenarios.run(story))
    assert [o.error for o in outcomes] == ["InvalidTokenCount", None, "NoNewTokens", None]
    assert all(o.state == o.before for o in outcomes if o.error)
    assert outcomes[-1].result == [[1, 2]]


def test_a_request_may_not_grow_past_the_token_bound(tmp_path: Path) -> None:
    steps = [{"op": "new_request", "args": {"request_id": "a", "prompt": [1] * 60000}}]
    steps += [
        {
            "op": "run_model",
            "args": {"request_id": "a", "num_computed_tokens": 0, "sampled": [1] * 3000},
        }
    ] * 2
    with pytest.raises(ScenarioError, match="exceeds"):
        request_scenarios.load(_write(tmp_path, _minimal(steps=steps)))
