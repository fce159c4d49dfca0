"""Pictures of the v0 allocator and the v0-versus-v1 page: drawn from the models, deterministic."""

import importlib.util
import re
from functools import cache
from pathlib import Path
from types import ModuleType
from xml.etree import ElementTree

import pytest

from kvpool.model import v0
from kvpool.specs.teaching import v0_pictures
from kvpool.specs.teaching.v0_pictures import (
    COMPARISON,
    comparison,
    comparison_markdown,
    comparison_pictures,
    physical_order,
    render_v0_svg,
    sequences,
)
from tests.v0.helpers import shared_prefix_state

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "explanation" / "v0-vs-v1.md"


@cache
def hook() -> ModuleType:
    """docs/hooks/v0_docs.py, imported by path as MkDocs does."""
    spec = importlib.util.spec_from_file_location("v0_docs_hook", ROOT / "docs/hooks/v0_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_picture_is_well_formed_and_a_pure_function_of_the_state() -> None:
    state = shared_prefix_state()
    svg = render_v0_svg(state, caption="shared", highlight=[0])
    ElementTree.fromstring(svg)
    assert svg == render_v0_svg(state, caption="shared", highlight=[0])
    assert " id=" not in svg


def test_a_picture_shows_the_free_lists_in_order() -> None:
    state = shared_prefix_state()
    for handle in sorted(state.handles):
        state, _ = v0.free(state, handle)
    svg = render_v0_svg(state)
    assert physical_order(svg, "next") == list(state.hashless_free)
    assert physical_order(svg, "evict") == list(v0.eviction_order(state))


def test_a_picture_draws_every_live_block_object_once_by_sequence() -> None:
    state = shared_prefix_state()
    svg = render_v0_svg(state)
    drawn = [int(h) for h in re.findall(r'<g data-handle="(\d+)">', svg)]
    assert sorted(drawn) == sorted(state.handles)
    assert sequences(state) == [(0, 1), (2,)]


def test_the_comparison_story_tells_what_its_notes_say() -> None:
    played = comparison()
    after_dedup = played[3][1]
    assert after_dedup.handles[3].block_id == after_dedup.handles[1].block_id == 1
    v1_after_dup = played[3][2]
    assert len(v1_after_dup.cached[(b"ABCD", 0)]) == 2  # v1 keeps both
    after_finish = played[4][1]
    assert v0.eviction_order(after_finish) == (1, 0)  # same time: deeper block first
    after_cow = played[7][1]
    assert after_cow.copy_on_writes == ((2, 3),)


def test_every_picture_is_generated_and_referenced_by_the_page() -> None:
    pictures = comparison_pictures()
    expected_v1 = 1 + sum(1 for step in COMPARISON if step.v1 is not None)
    assert len(pictures) == 1 + len(COMPARISON) + expected_v1
    markdown = comparison_markdown("explanation/v0-vs-v1.md")
    for path in pictures:
        assert f"](../{path})" in markdown
    for svg in pictures.values():
        ElementTree.fromstring(svg)


def test_the_page_uses_the_directives_and_the_hook_expands_them() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert "<!-- kvpool-v0:comparison -->" in text and "<!-- kvpool-v0:invariants -->" in text
    expanded = hook().expand(text, "explanation/v0-vs-v1.md")
    assert "kvpool-v0:" not in expanded
    assert "no_duplicate_content" in expanded and "v0-step-08.svg" in expanded
    with pytest.raises(ValueError, match="unknown directive"):
        hook().expand("<!-- kvpool-v0:nothing -->", "x.md")


def test_no_v0_picture_is_committed() -> None:
    folder = ROOT / "docs" / v0_pictures.PICTURES
    assert not folder.exists()
