"""specs/pictures.py: what the SVG shows, that it is deterministic, and that profiles show."""

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvpool import model
from kvpool.model import PoolState
from kvpool.specs.teaching import scenarios
from kvpool.specs.teaching.pictures import free_queue_order, hash_label, key_label, render_svg
from tests.docs.helpers import hook

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
ALL_OUTCOMES = [
    (s.name, outcome) for s in scenarios.BUILT_IN.values() for outcome in scenarios.run(s)
]


def _id(item: tuple[str, scenarios.Outcome]) -> str:
    return f"{item[0]}-{item[1].index}"


@pytest.mark.parametrize("item", ALL_OUTCOMES, ids=[_id(i) for i in ALL_OUTCOMES])
def test_every_picture_is_well_formed_and_shows_the_state(
    item: tuple[str, scenarios.Outcome],
) -> None:
    _, outcome = item
    state = outcome.state
    svg = render_svg(state, caption=outcome.step.say, highlight=outcome.changed)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert " id=" not in svg, "ids would clash when pictures are inlined together"
    assert free_queue_order(svg) == list(state.free_queue)
    held = [b for b in range(1, state.config.num_blocks) if state.blocks[b].ref_cnt > 0]
    held_part = svg[svg.index('<g class="held">') :]
    assert [int(b) for b in re.findall(r'<g data-block="(\d+)">', held_part)] == held
    for block_id in held:
        assert f">ref {state.blocks[block_id].ref_cnt}<" in svg
    assert '<g class="null-block">\n<g data-block="0">' in svg
    arrows = sum(len(ids) for ids in state.cached.values())
    assert svg.count("<path ") == arrows
    for key in state.cached:
        assert f">{key_label(key)}<" in svg.replace("&amp;", "&")
    assert svg.count('stroke="#d62728" stroke-width="3"') == len(outcome.changed)


def test_the_same_state_gives_the_same_bytes_whatever_the_map_order() -> None:
    state = scenarios.final_state(scenarios.get("tutorial"))
    reordered = PoolState(
        config=state.config,
        blocks=state.blocks,
        free_queue=state.free_queue,
        cached=dict(reversed(list(state.cached.items()))),
    )
    assert reordered == state
    assert render_svg(reordered, "x", [1]) == render_svg(state, "x", [1])


def test_the_caption_is_escaped() -> None:
    svg = render_svg(model.new_pool(2), caption='a <b> & "c"')
    ET.fromstring(svg)
    assert "a &lt;b&gt; &amp;" in svg


def test_empty_and_tiny_pools_are_drawn() -> None:
    for pool in (model.new_pool(1), model.get_new_blocks(model.new_pool(3), 2)[0]):
        svg = render_svg(pool)
        ET.fromstring(svg)
        assert "(empty" in svg


def test_duplicates_are_numbered_in_insertion_order() -> None:
    outcome = list(scenarios.run(scenarios.get("duplicates")))[7]
    assert outcome.state.cached[(b"A", 0)] == (2, 1)
    svg = render_svg(outcome.state)
    assert ">1st<" in svg and ">2nd<" in svg
    assert 'stroke-dasharray="6 4"' in svg  # the later duplicate


def test_partial_keys_are_dotted() -> None:
    pool, (block,) = model.get_new_blocks(model.new_pool(3, hash_block_size=2), 1)
    request = model.CacheRequest((b"AB", b"ABCD"))
    pool, _ = model.cache_full_blocks(pool, request, [block], 0, 1, 4, 0)
    pool, _ = model.cache_partial_block(pool, request, block, 2, 0, 4)
    assert pool.blocks[block].partial_keys == ((b"AB", 0),)
    svg = render_svg(pool)
    assert 'stroke-dasharray="2 3"/>' in svg and ">+1<" in svg


def test_hash_labels() -> None:
    assert hash_label(b"ABCDEFGHIJ") == "…DEFGHIJ"
    assert hash_label(b"\x00" * 32) == "…" + "00" * 3
    assert key_label((b"AB", 2)) == "AB g2"


def test_changing_the_free_order_profile_changes_the_picture() -> None:
    """The docs build draws from the model: another profile, another free-queue picture."""
    scenario = scenarios.get("hashless-first")
    pictures = {
        profile: hook().scenario_pictures(scenario.with_profile(profile))
        for profile in ("hashless-first", "append")
    }
    step = hook().picture_path(f"{scenario.name}@hashless-first", len(scenario.steps))
    first = pictures["hashless-first"][step]
    other_step = step.replace("@hashless-first", "@append")
    second = pictures["append"][other_step]
    assert free_queue_order(first) == [7, 2, 1]
    assert free_queue_order(second) == [6, 5, 4]
    assert free_queue_order(first) != free_queue_order(second)
    # and after the frees, before any allocation: the same blocks, another order
    freed = len(scenario.steps) - 1
    a = pictures["hashless-first"][hook().picture_path(f"{scenario.name}@hashless-first", freed)]
    b = pictures["append"][hook().picture_path(f"{scenario.name}@append", freed)]
    assert sorted(free_queue_order(a)) == sorted(free_queue_order(b))
    assert free_queue_order(a) != free_queue_order(b)


def test_snapshot_of_the_tutorial_picture() -> None:
    """A byte-for-byte snapshot; KVPOOL_UPDATE_SNAPSHOTS=1 rewrites it after a deliberate change."""
    outcome = list(scenarios.run(scenarios.get("tutorial")))[6]
    svg = render_svg(outcome.state, caption=outcome.step.say, highlight=outcome.changed)
    path = SNAPSHOTS / "tutorial-step-07.svg"
    if os.environ.get("KVPOOL_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(svg, encoding="utf-8")
    assert path.exists(), f"{path} is missing: KVPOOL_UPDATE_SNAPSHOTS=1 pytest writes it"
    assert svg == path.read_text(encoding="utf-8"), (
        "the tutorial picture changed; look at it, then KVPOOL_UPDATE_SNAPSHOTS=1 pytest"
    )
