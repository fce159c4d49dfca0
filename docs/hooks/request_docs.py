"""MkDocs hooks for the request-layer pages: pictures and reference drawn from the model.

Directives (HTML comments, so a page read on GitHub still makes sense):

``<!-- kvpool-request:picture SCENARIO N -->``   the picture after step N of a request scenario
                                                 (0: the new manager)
``<!-- kvpool-request:scenario SCENARIO -->``    every step: call, narration, facts, picture
``<!-- kvpool-request:figure NAME -->``          a named figure of ``request_figures``
``<!-- kvpool-request:operations MODULE -->``    every public function of ``kvpool.model.MODULE``
                                                 (manager, single_type, request, hashing):
                                                 signature, docstring, rejections
``<!-- kvpool-request:scenarios -->``            the built-in request scenarios as a table
``<!-- kvpool-text NAME -->``                    marks the ``text`` block after it as the
                                                 plain text of ``texts.text(NAME)`` (a test
                                                 checks it); the marker itself is removed

The pictures (``pictures/request/...`` and ``pictures/figures/...``) are
generated at build time, never committed.
"""

import importlib
import inspect
import posixpath
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvpool.specs.teaching import request_facts, request_figures, request_scenarios
from kvpool.specs.teaching import request_stories as stories
from kvpool.specs.teaching.request_explain import call_text, step_text
from kvpool.specs.teaching.request_pictures import render_outcome_svg, render_world_svg
from kvpool.specs.teaching.request_scenarios import RequestScenario

DIRECTIVE = re.compile(r"<!--\s*kvpool-request:([a-z-]+)((?:\s+[^\s>]+)*)\s*-->")
TEXT_MARK = re.compile(r"<!--\s*kvpool-text\s+[^\s>]+\s*-->\n?")
MODULES = ("manager", "single_type", "request", "hashing")
"""The request layer's modules of ``kvpool.model``, in the order the reference shows them."""


# --------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------


def picture_path(scenario: str, step: int) -> str:
    """Where the picture after ``step`` of a request scenario lives in the site."""
    return f"pictures/request/{scenario}/step-{step:02d}.svg"


def figure_path(name: str) -> str:
    return f"pictures/figures/{name}.svg"


def scenario_pictures(scenario: RequestScenario) -> dict[str, str]:
    """Every picture of a request scenario, by site path: the new manager, then one per step."""
    pictures = {
        picture_path(scenario.name, 0): render_world_svg(
            request_scenarios.initial_state(scenario), f"{scenario.name}: the new manager"
        )
    }
    total = len(scenario.steps)
    for outcome in request_scenarios.run(scenario):
        caption = f"{scenario.name}, step {outcome.index} of {total}: {outcome.step.say}"
        pictures[picture_path(scenario.name, outcome.index)] = render_outcome_svg(outcome, caption)
    return pictures


def all_pictures() -> dict[str, str]:
    """The pictures of every built-in request scenario and every figure."""
    pictures: dict[str, str] = {}
    for scenario in stories.BUILT_IN.values():
        pictures.update(scenario_pictures(scenario))
    for name in request_figures.NAMES:
        pictures[figure_path(name)] = request_figures.svg(name)
    return pictures


def _relative(page_src: str, target: str) -> str:
    return posixpath.relpath(target, posixpath.dirname(page_src) or ".")


def _image(page_src: str, path: str, alt: str) -> str:
    alt = alt.replace("[", "(").replace("]", ")")
    return f"![{alt}]({_relative(page_src, path)})"


def expand_picture(page_src: str, name: str, step: str) -> str:
    scenario = stories.get(name)
    index = int(step)
    if not 0 <= index <= len(scenario.steps):
        raise ValueError(f"{name} has no step {step}")
    alt = "the new manager" if index == 0 else scenario.steps[index - 1].say
    return _image(page_src, picture_path(name, index), alt)


def expand_figure(page_src: str, name: str) -> str:
    if name not in request_figures.FIGURES:
        raise ValueError(f"no figure {name!r}; known: {', '.join(request_figures.NAMES)}")
    return _image(page_src, figure_path(name), request_figures.FIGURES[name].title)


def expand_scenario(page_src: str, name: str) -> str:
    scenario = stories.get(name)
    lines = [
        f"*{scenario.summary}*",
        "",
        f"Replay it in a terminal: `kvpool explain {name}`.",
        "",
    ]
    for outcome in request_scenarios.run(scenario):
        call = call_text(outcome.step.op, dict(outcome.step.args))
        lines += [
            f"**Step {outcome.index}.** `{call}`",
            "",
            f"{outcome.step.say} *{request_facts.describe(outcome)}*",
            "",
        ]
        facts = step_text(outcome)
        if facts:
            lines += ["```text", facts, "```", ""]
        lines += [_image(page_src, picture_path(name, outcome.index), outcome.step.say), ""]
    return "\n".join(lines)


def expand_scenarios() -> str:
    rows = ["| scenario | what it shows | steps | groups |", "| --- | --- | --- | --- |"]
    for s in stories.BUILT_IN.values():
        groups = " + ".join(spec.attention.value for spec in s.setup.specs)
        rows.append(f"| `{s.name}` | {s.title} | {len(s.steps)} | {groups} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------
# Reference: the request layer's functions
# --------------------------------------------------------------------------


def model_module(name: str) -> ModuleType:
    if name not in MODULES:
        raise ValueError(f"{name} is not a request-layer module: {', '.join(MODULES)}")
    return importlib.import_module(f"kvpool.model.{name}")


def functions(name: str) -> list[Callable[..., Any]]:
    """The public functions a request-layer module defines, in source order."""
    module = model_module(name)
    found = [
        value
        for key, value in vars(module).items()
        if not key.startswith("_")
        and inspect.isfunction(value)
        and value.__module__ == module.__name__
    ]
    return sorted(found, key=lambda f: f.__code__.co_firstlineno)


def anchor(module: str, function: str) -> str:
    """The anchor of a function's section in the request-layer reference."""
    return f"{module}-{function}".replace("_", "-")


def _docstring_markdown(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    out: list[str] = []
    example: list[str] = []
    for line in doc.splitlines():
        if line.startswith(">>>") or (example and line.strip()):
            example.append(line)
            continue
        if example:
            out += ["```pycon", *example, "```", ""]
            example = []
        out.append(re.sub(r"``([^`]+)``", r"`\1`", line))
    if example:
        out += ["```pycon", *example, "```"]
    return "\n".join(out)


def rejections(function: Callable[..., Any]) -> list[str]:
    """The exception classes a function raises itself, in the order its source names them."""
    found: list[str] = []
    for name in re.findall(r"raise (\w+)\(", inspect.getsource(function)):
        if name not in found and name not in ("TypeError", "ValueError"):
            found.append(name)
    return found


def _signature(module: str, function: Callable[..., Any]) -> str:
    text = f"{module}.{function.__name__}{inspect.signature(function)}"
    text = re.sub(r"\bkvpool\.model\.[\w.]+\.(\w+)", r"\1", text)
    text = re.sub(r"\b(?:collections\.abc|typing)\.", "", text)
    if len(text) <= 88:
        return text
    head, _, rest = text.partition("(")
    params, _, returns = rest.rpartition(")")
    parts = [p.strip() for p in re.split(r",\s(?![^\[]*\])", params)]
    inner = "".join(f"    {p},\n" for p in parts if p)
    return f"{head}(\n{inner}){returns}"


def expand_operations(name: str) -> str:
    lines: list[str] = []
    for function in functions(name):
        lines += [
            f"### `{name}.{function.__name__}` {{#{anchor(name, function.__name__)}}}",
            "",
            "```python",
            _signature(name, function),
            "```",
            "",
            _docstring_markdown(function.__doc__ or ""),
            "",
        ]
        raised = rejections(function)
        if raised:
            names = ", ".join(f"`{r}`" for r in raised)
            lines += [f"**Raises** (besides what the functions it calls raise): {names}.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The directives
# --------------------------------------------------------------------------


def expand(markdown: str, page_src: str) -> str:
    """``markdown`` with every kvpool-request directive and kvpool-text marker expanded."""

    def replace(match: re.Match[str]) -> str:
        kind, args = match.group(1), match.group(2).split()
        if kind == "picture":
            return expand_picture(page_src, *args)
        if kind == "scenario":
            return expand_scenario(page_src, *args)
        if kind == "figure":
            return expand_figure(page_src, *args)
        if kind == "operations":
            return expand_operations(*args)
        if kind == "scenarios":
            return expand_scenarios()
        raise ValueError(f"{page_src}: unknown directive kvpool-request:{kind}")

    return TEXT_MARK.sub("", DIRECTIVE.sub(replace, markdown))


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, svg in all_pictures().items():
        files.append(File.generated(config, path, content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)
