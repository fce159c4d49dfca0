"""``kvpool explain``: every built-in scenario in the terminal and as HTML, vector files,
errors, and a screenshot showing that the HTML page really renders."""

import html
import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.specs import vectors
from kvpool.specs.cli import app
from kvpool.specs.teaching import request_scenarios, request_stories, scenarios
from kvpool.specs.teaching.explain import call_text, render_html
from kvpool.specs.teaching.request_explain import render_html as request_render_html
from tests.docs.helpers import assert_not_blank, screenshot

RUNNER = CliRunner()
NAMES = list(scenarios.BUILT_IN)


def explain(*args: str) -> tuple[int, str]:
    result = RUNNER.invoke(app, ["explain", *args], env={"COLUMNS": "120", "NO_COLOR": "1"})
    return result.exit_code, result.output


def test_help_and_list() -> None:
    code, out = explain("--help")
    assert code == 0 and "--html" in out and "--list" in out
    code, out = explain("--list")
    assert code == 0
    for name in NAMES:
        assert name in out
    assert "eviction/under-pressure" in out  # a bundled vector id


@pytest.mark.parametrize("name", NAMES)
def test_every_built_in_scenario_is_told_in_the_terminal(name: str) -> None:
    scenario = scenarios.get(name)
    code, out = explain(name)
    assert code == 0, out
    total = len(scenario.steps)
    for index in range(1, total + 1):
        assert f"Step {index}/{total}" in out
    # the new pool, then the pool after every step
    assert len(re.findall(r"^ free queue  next", out, re.M)) == total + 1
    assert scenario.steps[0].say.split()[0] in out


@pytest.mark.parametrize("name", NAMES)
def test_every_built_in_scenario_writes_html(name: str, tmp_path: Path) -> None:
    out_file = tmp_path / f"{name}.html"
    code, out = explain(name, "--html", str(out_file))
    assert code == 0, out
    page = out_file.read_text(encoding="utf-8")
    scenario = scenarios.get(name)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<svg ") == len(scenario.steps) + 1
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "<script" not in page and "src=" not in page  # self-contained
    for step in scenario.steps:
        assert call_text(step.op, dict(step.args)).split("(")[0] in page


def test_the_terminal_marks_what_changed_and_the_free_order() -> None:
    code, out = explain("tutorial")
    assert code == 0
    step_7 = out[out.index("Step 7/10") : out.index("Step 8/10")]
    queue = next(line for line in step_7.splitlines() if line.startswith(" free queue"))
    assert re.findall(r"\b(\d) ", queue.split("next ▸", 1)[1])[:7] == list("5467321")
    assert "Hash-less block(s) 5 went to the front" in step_7


def test_another_profile_tells_another_story() -> None:
    code, out = explain("hashless-first", "--profile", "append")
    assert code == 0 and "profile append" in out
    assert "went to the back of the queue (append)" in out
    code, out = explain("hashless-first", "--profile", "nope")
    assert code == 2


def test_a_vector_file_and_a_bundled_vector(tmp_path: Path) -> None:
    scenario = scenarios.get("partial-promoted")
    vector = vectors.vector_from_calls(
        scenario.config,
        [(s.op, dict(s.args)) for s in scenario.steps],
        "story/partial",
        "a partial block promoted",
    )
    file = tmp_path / "story.jsonl"
    file.write_text(vectors.dump_line(vector) + "\n")
    html = tmp_path / "story.html"
    code, out = explain(str(file), "--html", str(html))
    assert code == 0, out
    assert "story/partial" in out and "BlockStored" in out and "Dropped AB g0" in out
    assert html.read_text().count("<svg ") == len(scenario.steps) + 1
    code, out = explain("eviction/under-pressure")
    assert code == 0 and "differently from the vector" not in out


def test_errors_exit_2() -> None:
    assert explain()[0] == 2
    code, out = explain("no-such-scenario")
    assert code == 2
    code, out = explain("specs/vectors/data/scenarios.jsonl")
    assert code == 2  # several vectors: --vector picks one
    code, out = explain("specs/vectors/data/scenarios.jsonl", "--vector", "basics/null-block")
    assert code == 0, out


def test_the_html_page_renders_in_a_browser(tmp_path: Path) -> None:
    page = tmp_path / "tutorial.html"
    page.write_text(render_html(scenarios.get("tutorial")), encoding="utf-8")
    shot = screenshot(page.as_uri(), tmp_path / "tutorial.png", size="1000,800")
    assert_not_blank(shot)


def test_a_missing_chromium_skips_loudly_or_fails_when_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.docs import helpers

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("KVPOOL_REQUIRE_CHROMIUM", raising=False)
    with (
        pytest.warns(UserWarning, match="screenshot check skipped"),
        pytest.raises(pytest.skip.Exception, match="Chromium not found"),
    ):
        helpers.chromium_or_skip()
    monkeypatch.setenv("KVPOOL_REQUIRE_CHROMIUM", "1")
    with pytest.raises(pytest.fail.Exception, match="KVPOOL_REQUIRE_CHROMIUM=1"):
        helpers.chromium_or_skip()


# --------------------------------------------------------------------------
# The request layer
# --------------------------------------------------------------------------

REQUEST_NAMES = list(request_stories.BUILT_IN)


def test_list_shows_at_least_eight_request_layer_scenarios() -> None:
    code, out = explain("--list")
    assert code == 0 and "request-layer scenarios" in out
    listed = [name for name in REQUEST_NAMES if name in out]
    assert len(listed) >= 8 and listed == REQUEST_NAMES


@pytest.mark.parametrize("name", REQUEST_NAMES)
def test_every_request_scenario_is_told_in_the_terminal(name: str) -> None:
    story = request_stories.get(name)
    code, out = explain(name)
    assert code == 0, out
    total = len(story.steps)
    for index in range(1, total + 1):
        assert f"Step {index}/{total}" in out
    assert len(re.findall(r"^ free queue  next", out, re.M)) == total + 1
    assert len(re.findall(r"^g0 \(", out, re.M)) == total + 1  # the block tables, every step
    assert story.steps[0].say.split()[0] in out
    for outcome in request_scenarios.run(story):
        if outcome.step.op == "allocate_slots":
            assert "allocate_slots(" + str(outcome.step.args["request_id"]) + "): |" in out
        if outcome.step.op == "get_computed_blocks":
            assert f"-> {outcome.result['num_tokens']} tokens" in out


@pytest.mark.parametrize("name", REQUEST_NAMES)
def test_every_request_scenario_writes_html(name: str, tmp_path: Path) -> None:
    out_file = tmp_path / f"{name}.html"
    code, out = explain(name, "--html", str(out_file))
    assert code == 0, out
    page = out_file.read_text(encoding="utf-8")
    story = request_stories.get(name)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<figure>") == len(story.steps) + 1
    assert page.count('<g class="free-queue">') == len(story.steps) + 1
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "<script" not in page and "src=" not in page  # self-contained
    for step in story.steps:
        assert html.escape(step.say) in page


def test_a_request_scenario_under_another_profile() -> None:
    code, out = explain("request-life", "--profile", "append")
    assert code == 0 and "profile append" in out and "request-life@append" in out


def test_a_request_scenario_file_is_told_and_a_changed_answer_flagged(tmp_path: Path) -> None:
    data = request_scenarios.encode(request_stories.get("admission"))
    file = tmp_path / "story.jsonl"
    file.write_text(json.dumps(data) + "\n", encoding="utf-8")
    page = tmp_path / "story.html"
    code, out = explain(str(file), "--html", str(page))
    assert code == 0, out
    assert "admission" in out and "differently" not in out
    assert page.read_text(encoding="utf-8").count("<figure>") == len(data["steps"]) + 1
    data["steps"][7]["expect"] = {"ok": [[9]]}
    file.write_text(json.dumps(data) + "\n", encoding="utf-8")
    code, out = explain(str(file))
    assert code == 0 and "note: the file expects [[9]]" in out
    assert "1 step(s) answer differently from the scenario file" in out


def test_a_bad_request_scenario_file_exits_2(tmp_path: Path) -> None:
    data = request_scenarios.encode(request_stories.get("admission"))
    data["steps"][0]["op"] = "fly"
    file = tmp_path / "bad.jsonl"
    file.write_text(json.dumps(data) + "\n", encoding="utf-8")
    code, out = explain(str(file))
    assert code == 2 and "unknown operation 'fly'" in out
    two = tmp_path / "two.jsonl"
    good = request_scenarios.dump_line(request_stories.get("mamba-state"))
    two.write_text(good + "\n" + good.replace('"id":"mamba-state"', '"id":"again"') + "\n")
    assert explain(str(two))[0] == 2
    code, out = explain(str(two), "--vector", "again")
    assert code == 0 and "again" in out


def test_a_request_html_page_renders_in_a_browser(tmp_path: Path) -> None:
    page = tmp_path / "admission.html"
    page.write_text(request_render_html(request_stories.get("admission")), encoding="utf-8")
    shot = screenshot(page.as_uri(), tmp_path / "admission.png", size="1000,800")
    assert_not_blank(shot)
