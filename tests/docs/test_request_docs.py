"""The request layer's pages: plain-text examples equal the model's, every rule's example runs
on its own and names the model function that states it, and every page has its pictures."""

import doctest
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest

from kvpool import model
from kvpool.specs.teaching import request_figures, texts
from tests.docs.helpers import DOCS, markdown_pages, request_hook

REQUEST_PAGES = [
    "explanation/hash-chain.md",
    "explanation/hit-search.md",
    "explanation/hybrid.md",
    "explanation/admission.md",
    "explanation/request-life.md",
]
RULE_PAGES = ["rules/pool.md", "rules/request.md"]


def _marked() -> list[tuple[str, str, str]]:
    found = []
    for page in markdown_pages():
        for name, committed in texts.marked_blocks(page.read_text(encoding="utf-8")):
            found.append((str(page.relative_to(DOCS)), name, committed))
    return found


MARKED = _marked()


@pytest.mark.parametrize(
    ("page", "name", "committed"), MARKED, ids=[f"{p}:{n}" for p, n, _ in MARKED]
)
def test_every_plain_text_example_is_what_the_model_gives(
    page: str, name: str, committed: str
) -> None:
    expected = texts.text(name)
    assert committed == expected, (
        f"{page}: the block marked {name} is stale; regenerate it with\n"
        f"  python -m kvpool.specs.teaching.texts --update docs/{page}\n"
        f"it should read:\n{expected}"
    )


def test_every_marker_is_followed_by_a_text_block() -> None:
    for page in markdown_pages():
        markdown = page.read_text(encoding="utf-8")
        markers = re.findall(r"<!--\s*kvpool-text\s+(\S+)\s*-->", markdown)
        assert len(markers) == len(texts.marked_blocks(markdown)), page


def test_the_pool_gaps_are_shown_as_plain_text() -> None:
    names = {name for _, name, _ in MARKED}
    assert {
        "trace:evict-held-then-free",
        "trace:event-trace",
        "trace:duplicates-freed",
    } <= names
    trace = texts.text("trace:event-trace")
    for word in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "emits nothing"):
        assert word in trace
    for op in ("get_new_blocks", "touch", "free_blocks", "get_cached_block"):
        assert any(op in line for line in trace.splitlines())


@pytest.mark.parametrize("page", REQUEST_PAGES)
def test_each_request_page_has_a_picture_a_plain_text_example_and_runnable_python(
    page: str,
) -> None:
    markdown = (DOCS / page).read_text(encoding="utf-8")
    pictures = re.findall(r"<!--\s*kvpool-request:(?:picture|figure|scenario)\s", markdown)
    assert pictures, f"{page} has no generated picture"
    assert texts.marked_blocks(markdown), f"{page} has no plain-text worked example"
    assert "```pycon" in markdown, f"{page} has no Python example"
    nav = (DOCS.parent / "mkdocs.yml").read_text(encoding="utf-8")
    assert page in nav


def test_every_figure_is_used_and_every_text_name_exists() -> None:
    used = "\n".join(p.read_text(encoding="utf-8") for p in markdown_pages())
    for name in request_figures.NAMES:
        assert f"kvpool-request:figure {name}" in used, f"figure {name} is on no page"
        assert f"kvpool-text {name}" in used, f"figure {name} has no plain-text twin"
    for _, name, _ in MARKED:
        assert name in texts.names()
    with pytest.raises(KeyError):
        texts.text("trace:no-such-scenario")


def test_updating_a_page_rewrites_only_stale_blocks() -> None:
    page = "intro\n<!-- kvpool-text hash-chain -->\n```text\nstale\n```\noutro\n"
    updated = texts.update(page)
    assert updated.startswith("intro\n") and updated.endswith("\n```\noutro\n")
    assert texts.marked_blocks(updated) == [("hash-chain", texts.text("hash-chain"))]
    assert texts.update(updated) == updated


# --------------------------------------------------------------------------
# Rules at a glance
# --------------------------------------------------------------------------

LINK = re.compile(r"\]\(\.\./reference/(operations|request-operations)\.md#([\w-]+)\)")


def _rules() -> list[tuple[str, str, str]]:
    rules = []
    for page in RULE_PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        for section in re.split(r"^### ", text, flags=re.M)[1:]:
            rules.append((page, section.splitlines()[0].split(".")[0], section))
    return rules


RULES = _rules()


def _function_of(reference: str, anchor: str) -> object:
    if reference == "operations":
        return getattr(model, anchor)
    for module in request_hook().MODULES:
        prefix = module.replace("_", "-") + "-"
        if anchor.startswith(prefix):
            name = anchor.removeprefix(prefix).replace("-", "_")
            return getattr(importlib.import_module(f"kvpool.model.{module}"), name)
    raise AssertionError(f"#{anchor} names no request-layer module")


def test_the_rules_pages_hold_many_rules() -> None:
    pool = [r for r in RULES if r[0] == "rules/pool.md"]
    request = [r for r in RULES if r[0] == "rules/request.md"]
    assert len(pool) >= 12 and len(request) >= 15
    assert [r[1] for r in pool] == [f"P{i}" for i in range(1, len(pool) + 1)]
    assert [r[1] for r in request] == [f"R{i}" for i in range(1, len(request) + 1)]


@pytest.mark.parametrize(("page", "rule", "section"), RULES, ids=[r[1] for r in RULES])
def test_each_rule_links_to_the_model_function_that_states_it(
    page: str, rule: str, section: str
) -> None:
    links = LINK.findall(section)
    assert links, f"{page} {rule} links to no model function"
    for reference, anchor in links:
        function = _function_of(reference, anchor)
        assert inspect.isfunction(function), f"{rule}: #{anchor} is not a model function"
        assert function.__module__.startswith("kvpool.model.")


@pytest.mark.parametrize(("page", "rule", "section"), RULES, ids=[r[1] for r in RULES])
def test_each_rule_example_runs_as_written_on_its_own(page: str, rule: str, section: str) -> None:
    test = doctest.DocTestParser().get_doctest(section, {}, rule, str(DOCS / page), 0)
    assert test.examples, f"{page} {rule} has no example"
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# --------------------------------------------------------------------------
# The request-layer reference and the hook
# --------------------------------------------------------------------------


def test_the_reference_shows_every_public_function_of_the_request_layer() -> None:
    page = (DOCS / "reference" / "request-operations.md").read_text(encoding="utf-8")
    hook = request_hook()
    total = 0
    for module in hook.MODULES:
        assert f"<!-- kvpool-request:operations {module} -->" in page
        expanded = hook.expand_operations(module)
        for function in hook.functions(module):
            total += 1
            assert f"### `{module}.{function.__name__}`" in expanded
            assert f"{{#{hook.anchor(module, function.__name__)}}}" in expanded
    assert total >= 40
    assert "HitOnRunningRequest" in hook.expand_operations("manager")


def test_bad_request_directives_fail_the_build() -> None:
    hook = request_hook()
    with pytest.raises(ValueError, match="unknown directive"):
        hook.expand("<!-- kvpool-request:nonsense -->", "index.md")
    with pytest.raises(ValueError, match="no step"):
        hook.expand("<!-- kvpool-request:picture request-life 11 -->", "index.md")
    with pytest.raises(ValueError, match="no figure"):
        hook.expand("<!-- kvpool-request:figure nothing -->", "index.md")
    with pytest.raises(ValueError, match="not a request-layer module"):
        hook.expand("<!-- kvpool-request:operations pool -->", "index.md")


def test_a_picture_directive_becomes_a_relative_image_link() -> None:
    expanded = request_hook().expand(
        "<!-- kvpool-request:picture request-life 3 -->", "explanation/x.md"
    )
    assert (
        expanded.startswith("![") and "(../pictures/request/request-life/step-03.svg)" in expanded
    )
    assert request_hook().expand("<!-- kvpool-text hash-chain -->\n```text\n", "x.md") == (
        "```text\n"
    )


def test_no_generated_request_picture_is_committed() -> None:
    assert not list(Path(DOCS).rglob("*.svg"))


def test_the_scenario_file_example_in_the_formats_page_is_a_valid_scenario() -> None:
    from kvpool.specs.teaching import request_scenarios

    page = (DOCS / "formats.md").read_text(encoding="utf-8")
    section = page.split("## Request-layer scenario files", 1)[1]
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    story = request_scenarios.decode(json.loads(example))
    outcomes = list(request_scenarios.run(story))
    assert [o.step.op for o in outcomes] == ["new_request", "allocate_slots", "free"]
    assert all(o.mismatch is None and o.error is None for o in outcomes)
