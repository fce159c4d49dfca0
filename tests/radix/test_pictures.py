"""Pictures of the radix cache and the side-by-side page: drawn from the models, deterministic."""

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType
from xml.etree import ElementTree

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.model import radix
from kvpool.specs.teaching.radix_pictures import (
    SIDE_BY_SIDE,
    node_paths,
    render_radix_svg,
    side_by_side_markdown,
    side_by_side_pictures,
    story,
)

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "explanation" / "side-by-side.md"


@cache
def hook() -> ModuleType:
    """docs/hooks/radix_docs.py, imported by path as MkDocs does."""
    path = ROOT / "docs/hooks/radix_docs.py"
    spec = importlib.util.spec_from_file_location("radix_docs_hook", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=25, deadline=None)
@given(keys=st.lists(st.lists(st.integers(1, 3), max_size=6), max_size=6), lock=st.booleans())
def test_a_picture_is_well_formed_and_shows_every_node(keys: list[list[int]], lock: bool) -> None:
    state = radix.new_radix_cache(2)
    for n, key in enumerate(keys):
        state, result = radix.insert(state, key, list(range(10 * n, 10 * n + len(key))))
        if lock and result.path:
            state, _ = radix.lock(state, result.path)
    svg = render_radix_svg(state, caption="a cache", highlight=list(state.nodes)[:1])
    ElementTree.fromstring(svg)
    assert " id=" not in svg
    assert sorted(node_paths(svg)) == sorted(state.nodes)
    assert svg == render_radix_svg(state, caption="a cache", highlight=list(state.nodes)[:1])
    assert svg.count('stroke="#d62728" stroke-width="3"') == min(len(state.nodes), 1)
    for node in state.nodes.values():
        if node.lock_ref:
            assert f"lock {node.lock_ref}" in svg
        assert "slots " + " ".join(map(str, node.slots)) in svg
    assert f"evictable {radix.evictable_size(state)}" in svg


def test_the_story_shows_what_the_page_says() -> None:
    played = story()
    assert len(played) == len(SIDE_BY_SIDE) == 5
    _, after_hit = played[1]
    assert sorted(after_hit.radix.nodes) == [(65, 66), (65, 66, 67, 68), (65, 66, 69, 70)]
    _, after_dup = played[2]
    assert after_dup.v1.cached[(b"AB", 0)] == (1, 4)  # v1 keeps the duplicate
    assert after_dup.v0.cached[(65, 66)] == 0 and len(after_dup.v0.cached) == 3  # v0 does not
    assert radix.total_size(after_dup.radix) == 6  # SGLang neither: it returned the copy
    _, finished = played[3]
    assert radix.protected_size(finished.radix) == 0
    _, evicted = played[4]
    assert sorted(evicted.radix.nodes) == [(65, 66)]


def test_every_step_has_three_pictures_and_the_page_shows_them() -> None:
    pictures = side_by_side_pictures()
    assert len(pictures) == 3 * len(SIDE_BY_SIDE)
    markdown = side_by_side_markdown("explanation/side-by-side.md")
    for path in pictures:
        assert f"](../{path})" in markdown


def test_the_page_uses_the_directives_and_the_hook_expands_them() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for kind in ("side-by-side", "invariants", "operations"):
        assert f"<!-- kvpool-radix:{kind} -->" in text
    expanded = hook().expand(text, "explanation/side-by-side.md")
    assert "kvpool-radix:" not in expanded
    assert "`event_stream_consistency` (engine-neutral)" in expanded
    assert "Rejects: `InvalidTokens`" in expanded


def test_an_unknown_directive_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown directive"):
        hook().expand("<!-- kvpool-radix:nonsense -->", "x.md")


def test_the_findings_table_lists_every_finding() -> None:
    from kvpool.specs.targets.sglang.findings import KNOWN_FINDINGS

    table = hook().expand_findings()
    for key in KNOWN_FINDINGS:
        assert f"`{key}`" in table
