"""specs/teaching/request_pictures.py: what a request-layer picture shows, deterministically."""

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvpool.model import NULL_BLOCK_ID
from kvpool.specs.teaching import request_facts as facts
from kvpool.specs.teaching import request_figures, request_scenarios, request_stories
from kvpool.specs.teaching.pictures import free_queue_order
from kvpool.specs.teaching.request_pictures import render_outcome_svg, render_world_svg

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
OUTCOMES = [
    (s.name, o) for s in request_stories.BUILT_IN.values() for o in request_scenarios.run(s)
]


def _id(item: tuple[str, request_scenarios.Outcome]) -> str:
    return f"{item[0]}-{item[1].index}"


def _panel(svg: str, title_start: str) -> str:
    start = svg.index(f'data-panel="{title_start}')
    end = svg.find('<g class="panel"', start + 1)
    return svg[start : end if end > 0 else len(svg)]


@pytest.mark.parametrize("item", OUTCOMES, ids=[_id(i) for i in OUTCOMES])
def test_every_step_picture_is_well_formed_and_shows_the_state(
    item: tuple[str, request_scenarios.Outcome],
) -> None:
    _, outcome = item
    svg = render_outcome_svg(outcome, outcome.step.say)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert " id=" not in svg, "ids would clash when pictures are inlined together"
    assert svg == render_outcome_svg(outcome, outcome.step.say)
    world = outcome.state
    assert free_queue_order(svg) == list(world.pool.free_queue)
    tables = _panel(svg, "block tables")
    for g, table in enumerate(world.manager.managers.tables):
        for rid, blocks in table.req_to_blocks.items():
            row = tables.split(f'<g class="table" data-group="{g}" data-request="{rid}">')[1]
            row = row.split('<g class="table"')[0]
            shown = [int(b) for b in re.findall(r'<g data-block="(\d+)">', row)]
            assert shown == list(blocks)
    for rid in world.requests:
        assert f">{rid}</text>" in _panel(svg, "requests")


@pytest.mark.parametrize(
    "item",
    [i for i in OUTCOMES if i[1].step.op == "get_computed_blocks"],
    ids=[_id(i) for i in OUTCOMES if i[1].step.op == "get_computed_blocks"],
)
def test_a_lookup_shows_one_row_per_group_with_its_hit(
    item: tuple[str, request_scenarios.Outcome],
) -> None:
    _, outcome = item
    svg = render_outcome_svg(outcome)
    panel = _panel(svg, "lookup of request")
    assert isinstance(outcome.result, dict)
    rows = re.findall(r'<g class="hit-row" data-tokens="(\d+)">', panel)
    assert len(rows) == len(outcome.state.manager.managers.specs)
    assert all(int(n) == outcome.result["num_tokens"] for n in rows)
    hit_blocks = [b for group in outcome.result["blocks"] for b in group]
    hits = panel.count(f'data-kind="{facts.HIT}"')
    nulls = panel.count(f'data-kind="{facts.SKIPPED}"')
    assert hits == sum(1 for b in hit_blocks if b != NULL_BLOCK_ID)
    assert nulls == sum(1 for b in hit_blocks if b == NULL_BLOCK_ID)


@pytest.mark.parametrize(
    "item",
    [i for i in OUTCOMES if i[1].step.op in ("allocate_slots", "free", "preempt")],
    ids=[_id(i) for i in OUTCOMES if i[1].step.op in ("allocate_slots", "free", "preempt")],
)
def test_admission_and_release_panels_tell_the_verdict_and_the_order(
    item: tuple[str, request_scenarios.Outcome],
) -> None:
    _, outcome = item
    svg = render_outcome_svg(outcome)
    if outcome.step.op == "allocate_slots":
        panel = _panel(svg, "allocate_slots(")
        verdict = "admitted" if outcome.result is not None else "refused"
        assert verdict in panel
    else:
        panel = _panel(svg, "freed, in this order")
        rid = str(outcome.step.args["request_id"])
        order = [b for _, b in facts.freed_order(outcome.before, rid)]
        assert [int(b) for b in re.findall(r'<g data-block="(\d+)" data-where', panel)] == order


def test_the_new_manager_and_the_figures_are_drawn() -> None:
    story = request_stories.get("hybrid-hit")
    svg = render_world_svg(request_scenarios.initial_state(story), "start")
    ET.fromstring(svg)
    assert "(no request holds blocks in this group)" in svg
    for name in request_figures.NAMES:
        figure = request_figures.svg(name)
        ET.fromstring(figure)
        assert " id=" not in figure and figure == request_figures.svg(name)
        assert request_figures.text(name).strip()


def test_the_hit_windows_figure_shows_each_attention_type() -> None:
    svg = request_figures.svg("hit-windows")
    assert [int(n) for n in re.findall(r'data-tokens="(\d+)"', svg)] == [2, 10, 10, 0]
    assert f'data-kind="{facts.STATE}"' in svg


def test_snapshot_of_a_request_life_picture() -> None:
    """A byte-for-byte snapshot; KVPOOL_UPDATE_SNAPSHOTS=1 rewrites it after a deliberate change."""
    outcome = list(request_scenarios.run(request_stories.get("request-life")))[7]
    svg = render_outcome_svg(outcome, outcome.step.say)
    path = SNAPSHOTS / "request-life-step-08.svg"
    if os.environ.get("KVPOOL_UPDATE_SNAPSHOTS") == "1":
        path.write_text(svg, encoding="utf-8")
    assert path.exists(), f"{path} is missing: KVPOOL_UPDATE_SNAPSHOTS=1 pytest writes it"
    assert svg == path.read_text(encoding="utf-8"), (
        "the request-life picture changed; look at it, then KVPOOL_UPDATE_SNAPSHOTS=1 pytest"
    )
