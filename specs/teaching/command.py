"""``kvpool explain``: a scenario told step by step, the pool or the request layer drawn after each.

The scenario is a built-in one (``kvpool explain --list``: pool scenarios and
request-layer scenarios), a conformance vector file (``.jsonl``: the vector a
divergence writes beside its regression test is one), a request-layer
scenario file (``.jsonl`` lines with ``"layer": "request"``,
``request_scenarios``), or the id of a vector in the bundled corpus. Each
step is run on the model; the terminal shows the narration, the result, the
events and the state; ``--html OUT`` writes the same as one self-contained
page with an SVG picture per step.
"""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.columns import Columns
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvpool.model import PROFILES
from kvpool.specs.teaching import explain as pool_explain
from kvpool.specs.teaching import request_explain, request_scenarios, request_stories, scenarios
from kvpool.specs.teaching.request_scenarios import RequestScenario
from kvpool.specs.teaching.scenarios import Scenario, ScenarioError

EXIT_OK, EXIT_ERROR = 0, 2

Story = Scenario | RequestScenario
"""A pool scenario or a request-layer scenario."""


def resolve(spec: str, scenario_id: str | None = None) -> Story:
    """A built-in scenario of either layer, a vector or request scenario file, or a vector id."""
    if spec in request_stories.BUILT_IN:
        return request_stories.BUILT_IN[spec]
    if spec in scenarios.BUILT_IN:
        return scenarios.BUILT_IN[spec]
    path = Path(spec)
    if path.is_file() and request_scenarios.is_request_file(path):
        return request_scenarios.load(path, scenario_id)
    try:
        return scenarios.resolve(spec, scenario_id)
    except ScenarioError as error:
        if path.is_file():
            raise
        names = ", ".join([*request_stories.BUILT_IN, *scenarios.BUILT_IN])
        raise ScenarioError(
            f"{spec!r} is not a built-in scenario ({names}), a vector or request scenario "
            "file, or the id of a bundled vector (kvpool explain --list)"
        ) from error


def _list(console: Console) -> None:
    table = Table("scenario", "what it shows", "steps", "profile", title="pool scenarios")
    for s in scenarios.BUILT_IN.values():
        table.add_row(s.name, s.title, str(len(s.steps)), s.config.profile.name)
    console.print(table)
    console.print(request_explain.list_table())
    from kvpool.specs.vectors import bundled_corpus

    ids = []
    scenario_file = bundled_corpus() / "scenarios.jsonl"
    if scenario_file.is_file():
        for line in scenario_file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                ids.append(str(json.loads(line)["id"]))
    console.print(
        "Also: any conformance vector file (.jsonl, e.g. the one `kvpool check` writes "
        "beside a regression test; --vector ID picks one of several), any request-layer "
        'scenario file (.jsonl lines with "layer": "request"), or the id of a bundled vector:',
        highlight=False,
        markup=False,
    )
    console.print(Columns(ids, padding=(0, 3)))


def _fail(errors: Console, message: str) -> typer.Exit:
    errors.print(Text(message, style="red"))
    return typer.Exit(EXIT_ERROR)


def explain(
    scenario: Annotated[
        str | None,
        typer.Argument(
            help="A built-in scenario (see --list), a vector or request scenario file "
            "(.jsonl) or a bundled vector id.",
            show_default=False,
        ),
    ] = None,
    list_scenarios: Annotated[
        bool, typer.Option("--list", help="List the built-in scenarios and exit.")
    ] = False,
    html_out: Annotated[
        Path | None,
        typer.Option(
            "--html", help="Also write a self-contained HTML page with a picture per step."
        ),
    ] = None,
    vector: Annotated[
        str | None,
        typer.Option(help="The id of the vector or scenario to explain, in a file of several."),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(help=f"Replay under another semantics profile: {', '.join(PROFILES)}."),
    ] = None,
) -> None:
    """Step through a scenario on the model, drawing the pool after every operation."""
    console = Console(highlight=False)
    errors = Console(stderr=True)
    if list_scenarios:
        _list(console)
        return
    if scenario is None:
        raise _fail(errors, "name a scenario (kvpool explain --list shows them)")
    try:
        chosen = resolve(scenario, vector)
    except ScenarioError as error:
        raise _fail(errors, str(error)) from error
    if profile is not None:
        if profile not in PROFILES:
            raise _fail(errors, f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
        chosen = chosen.with_profile(profile)
    try:
        if isinstance(chosen, RequestScenario):
            mismatches = request_explain.print_scenario(console, chosen)
            page = request_explain.render_html(chosen) if html_out is not None else ""
        else:
            mismatches = pool_explain.print_scenario(console, chosen)
            page = pool_explain.render_html(chosen) if html_out is not None else ""
    except ScenarioError as error:
        raise _fail(errors, str(error)) from error
    if mismatches:
        source = "scenario file" if isinstance(chosen, RequestScenario) else "vector"
        console.print(
            Text(
                f"{mismatches} step(s) answer differently from the {source}: it was recorded "
                "by another version of the model, or by a diverging target.",
                style="red",
            )
        )
    if html_out is not None:
        try:
            html_out.write_text(page, encoding="utf-8")
        except OSError as error:
            raise _fail(errors, f"cannot write {html_out}: {error}") from error
        console.print(f"wrote {html_out}", markup=False)
