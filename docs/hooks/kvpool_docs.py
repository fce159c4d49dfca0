"""MkDocs hooks: everything the site shows about the model is generated from it at build time.

* ``on_files`` adds one SVG per step of every built-in scenario
  (``pictures/<scenario>/step-NN.svg``, drawn by ``kvpool.specs.teaching.pictures``);
  no picture is ever committed.
* ``on_page_markdown`` expands directives written as HTML comments, so a page
  read on the repository host still makes sense (there, the line after each
  directive that starts ``> *Built from the code when the site is built.*``
  says where the content comes from; the site drops that line):

  ``<!-- kvpool:picture SCENARIO N -->``    the picture after step N (0: the new pool)
  ``<!-- kvpool:scenario SCENARIO -->``     every step: call, narration, picture
  ``<!-- kvpool:operation NAME -->``        signature, docstring and rejections of a
                                            ``kvpool.model`` operation
  ``<!-- kvpool:invariants -->``            every named invariant with its rationale
  ``<!-- kvpool:event-invariants -->``      the events layer's invariants, likewise
  ``<!-- kvpool:profiles -->``              the semantics profiles as a table
  ``<!-- kvpool:errors -->``                the rejections (``kvpool.model.errors``)
  ``<!-- kvpool:cli COMMAND... -->``        usage and options of a ``kvpool`` command
  ``<!-- kvpool:scenarios -->``             the built-in scenarios as a table

The functions are plain Python so the tests can call them without MkDocs.
"""

import inspect
import posixpath
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import typer.main

from kvpool import model
from kvpool.model import errors as model_errors
from kvpool.model import pool as model_pool
from kvpool.specs.pool import invariants
from kvpool.specs.teaching import scenarios
from kvpool.specs.teaching.explain import call_text, describe
from kvpool.specs.teaching.pictures import render_svg
from kvpool.specs.teaching.scenarios import Scenario

PICTURES = "pictures"
DIRECTIVE = re.compile(r"<!--\s*kvpool:([a-z-]+)((?:\s+[^\s>]+)*)\s*-->")
HOST_NOTE = re.compile(r"^> \*Built from the code when the site is built\.\*.*\n?", re.M)
"""A line for readers of the page on the repository host, where directives show nothing:
it says where the generated content comes from. The site, which shows that content, drops it."""


# --------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------


def picture_path(scenario: str, step: int) -> str:
    """Where the picture after ``step`` of ``scenario`` lives in the site."""
    return f"{PICTURES}/{scenario}/step-{step:02d}.svg"


def scenario_pictures(scenario: Scenario) -> dict[str, str]:
    """Every picture of a scenario, by site path: the new pool, then one per step."""
    pictures = {
        picture_path(scenario.name, 0): render_svg(
            scenarios.initial_state(scenario), caption=f"{scenario.name}: the new pool"
        )
    }
    for outcome in scenarios.run(scenario):
        caption = f"{scenario.name}, after step {outcome.index}: {outcome.step.op}"
        pictures[picture_path(scenario.name, outcome.index)] = render_svg(
            outcome.state, caption=caption, highlight=outcome.changed
        )
    return pictures


def all_pictures() -> dict[str, str]:
    """The pictures of every built-in scenario."""
    pictures: dict[str, str] = {}
    for scenario in scenarios.BUILT_IN.values():
        pictures.update(scenario_pictures(scenario))
    return pictures


def _relative(page_src: str, target: str) -> str:
    return posixpath.relpath(target, posixpath.dirname(page_src) or ".")


def _picture(page_src: str, name: str, step: int, alt: str) -> str:
    scenario = scenarios.get(name)
    if not 0 <= step <= len(scenario.steps):
        raise ValueError(f"{name} has no step {step}")
    alt = alt.replace("[", "(").replace("]", ")")
    return f"![{alt}]({_relative(page_src, picture_path(name, step))})"


def expand_picture(page_src: str, name: str, step: str) -> str:
    scenario = scenarios.get(name)
    index = int(step)
    if not 0 <= index <= len(scenario.steps):
        raise ValueError(f"{name} has no step {step}")
    alt = "the new pool" if index == 0 else scenario.steps[index - 1].say
    return _picture(page_src, name, index, alt)


def expand_scenario(page_src: str, name: str) -> str:
    scenario = scenarios.get(name)
    lines = [
        f"*{scenario.summary}*" if scenario.summary else "",
        "",
        f"Replay it in a terminal: `kvpool explain {name}`. Pool: "
        f"{scenario.config.num_blocks} blocks, profile `{scenario.config.profile.name}`, "
        f"hash block size {scenario.config.hash_block_size}.",
        "",
        _picture(page_src, name, 0, "the new pool"),
        "",
    ]
    for outcome in scenarios.run(scenario):
        call = call_text(outcome.step.op, dict(outcome.step.args))
        lines += [
            f"**Step {outcome.index}.** `{call}`",
            "",
            f"{outcome.step.say} *{describe(outcome)}*",
            "",
        ]
        if outcome.state == outcome.before:
            lines += ["*(The pool is unchanged: no new picture.)*", ""]
        else:
            lines += [_picture(page_src, name, outcome.index, outcome.step.say), ""]
    return "\n".join(lines)


def expand_scenarios() -> str:
    rows = ["| scenario | what it shows | steps | profile |", "| --- | --- | --- | --- |"]
    for s in scenarios.BUILT_IN.values():
        rows.append(f"| `{s.name}` | {s.title} | {len(s.steps)} | `{s.config.profile.name}` |")
    return "\n".join(rows)


# --------------------------------------------------------------------------
# Reference: operations, rejections, invariants, profiles
# --------------------------------------------------------------------------


def operations() -> list[str]:
    """The public operations of the model: the functions in ``kvpool.model.__all__``."""
    return [n for n in model.__all__ if inspect.isfunction(getattr(model, n))]


def _docstring_markdown(doc: str) -> str:
    """A docstring as Markdown: ``literal`` becomes `literal`, examples a pycon block."""
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


def _verify_helpers() -> dict[str, list[str]]:
    helpers: dict[str, list[str]] = {}
    for name, function in vars(model_pool).items():
        if name.startswith("_verify") and inspect.isfunction(function):
            helpers[name] = re.findall(r"raise (\w+)\(", inspect.getsource(function))
    return helpers


def rejections(function: Callable[..., Any]) -> list[str]:
    """The exception classes an operation raises, in the order its source checks them."""
    helpers = _verify_helpers()
    found: list[str] = []
    source = inspect.getsource(function)
    for match in re.finditer(r"raise (\w+)\(|(_verify\w*)\(", source):
        names = [match.group(1)] if match.group(1) else helpers.get(match.group(2), [])
        for name in names:
            if name not in found:
                found.append(name)
    return found


def _annotation(annotation: Any) -> str:
    text = inspect.formatannotation(annotation)
    return re.sub(r"\b(?:kvpool\.model\.\w+|collections\.abc|typing)\.", "", text)


def signature_text(function: Callable[..., Any]) -> str:
    """``model.name(arg: type = default, ...) -> type``, one argument a line when long."""
    signature = inspect.signature(function)
    params = []
    for param in signature.parameters.values():
        text = param.name
        if param.annotation is not inspect.Parameter.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not inspect.Parameter.empty:
            default = "DEFAULT_PROFILE" if param.default is model.DEFAULT_PROFILE else None
            text += f" = {default or repr(param.default)}"
        params.append(text)
    returns = ""
    if signature.return_annotation is not inspect.Signature.empty:
        returns = f" -> {_annotation(signature.return_annotation)}"
    one_line = f"model.{function.__name__}({', '.join(params)}){returns}"
    if len(one_line) <= 88:
        return one_line
    inner = "".join(f"    {p},\n" for p in params)
    return f"model.{function.__name__}(\n{inner}){returns}"


def expand_operation(name: str) -> str:
    function = getattr(model, name)
    if name not in operations():
        raise ValueError(f"{name} is not a public operation of kvpool.model")
    lines = [
        "```python",
        signature_text(function),
        "```",
        "",
        _docstring_markdown(function.__doc__ or ""),
        "",
    ]
    raised = rejections(function)
    if raised:
        links = ", ".join(f"[`{r}`](#{r.lower()})" for r in raised)
        lines.append(f"**Rejects** (checked in this order, the state left unchanged): {links}.")
    else:
        lines.append("**Rejects** nothing: every call is valid.")
    return "\n".join(lines)


def expand_errors() -> str:
    lines = []
    for name, cls in vars(model_errors).items():
        if isinstance(cls, type) and issubclass(cls, model.PoolError):
            bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
            lines += [f"### `{name}`", "", f"{inspect.getdoc(cls)} Bases: {bases}.", ""]
    return "\n".join(lines)


def all_invariants() -> list[Callable[..., Any]]:
    """Every named invariant: the state invariants, LRU order, event-stream consistency."""
    return [*invariants.STATE_INVARIANTS, invariants.lru_order, invariants.event_stream_consistency]


def event_invariants() -> list[Callable[..., Any]]:
    """The events layer's invariants over one query's scores."""
    from kvpool.specs.events.invariants import SCORE_INVARIANTS

    return list(SCORE_INVARIANTS)


def expand_invariants(checks: list[Callable[..., Any]] | None = None) -> str:
    lines: list[str] = []
    for check in all_invariants() if checks is None else checks:
        doc = inspect.cleandoc(check.__doc__ or "")
        first, _, rest = doc.partition("\n")
        lines += [
            f"### `{check.__name__}`",
            "",
            f"**{first.strip()}**",
            "",
            re.sub(r"``([^`]+)``", r"`\1`", textwrap.dedent(rest).strip()),
            "",
        ]
    return "\n".join(lines)


def expand_profiles() -> str:
    rows = [
        "| profile | free order, caching on | free order, caching off | vLLM releases |",
        "| --- | --- | --- | --- |",
    ]
    for p in model.PROFILES.values():
        default = " (default)" if p is model.DEFAULT_PROFILE else ""
        rows.append(
            f"| `{p.name}`{default} | `{p.free_order.value}` | "
            f"`{p.free_order_without_caching.value}` | {p.releases} |"
        )
    rows += ["", "| event semantics (`+name`) | when a removal is published |", "| --- | --- |"]
    for semantics in model.EventSemantics:
        default = " (default)" if semantics is model.DEFAULT_PROFILE.event_semantics else ""
        doc = re.sub(r"``([^`]+)``", r"`\1`", " ".join(event_semantics_doc(semantics).split()))
        rows.append(f"| `{semantics.value}`{default} | {doc} |")
    return "\n".join(rows)


def event_semantics_doc(semantics: Any) -> str:
    """The docstring of an ``EventSemantics`` member, read from the model's source."""
    import ast
    import inspect

    from kvpool.model import profiles

    tree = ast.parse(inspect.getsource(profiles))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "EventSemantics":
            body = node.body
            for i, item in enumerate(body[:-1]):
                target = getattr(item, "targets", [None])[0]
                following = body[i + 1]
                if (
                    isinstance(target, ast.Name)
                    and target.id == semantics.name
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                ):
                    return str(following.value.value)
    return ""


# --------------------------------------------------------------------------
# Reference: the CLI
# --------------------------------------------------------------------------


# Typer may vendor its own copy of click, so commands are duck-typed here:
# a group is a command with a ``commands`` mapping.


def cli_root() -> Any:
    from kvpool.specs.cli import app

    return typer.main.get_command(app)


def subcommands(command: Any) -> dict[str, Any]:
    """A group's commands by name; empty for a plain command."""
    return dict(getattr(command, "commands", None) or {})


def cli_commands(group: Any = None, prefix: str = "kvpool") -> Iterator[str]:
    """Every command of the CLI, as ``kvpool NAME`` / ``kvpool GROUP NAME``."""
    group = cli_root() if group is None else group
    for name, command in subcommands(group).items():
        yield f"{prefix} {name}"
        yield from cli_commands(command, f"{prefix} {name}")


def find_command(path: str) -> Any:
    command = cli_root()
    for name in path.split()[1:]:
        children = subcommands(command)
        if name not in children:
            raise ValueError(f"no command {path!r}")
        command = children[name]
    return command


def _type_name(param: Any, ctx: Any) -> str:
    """The value type of an option, whichever click Typer uses."""
    display = getattr(param, "display_type", None)
    if callable(display):
        return str(display(ctx)).strip("<>")
    kind = getattr(param, "type", None)
    return str(getattr(kind, "name", "text"))


def expand_cli(path: str) -> str:
    command = find_command(path)
    ctx = command.context_class(command, info_name=path)
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines = [
        "```text",
        f"{path} {usage}".rstrip(),
        "```",
        "",
        inspect.cleandoc(command.help or "").split("\n\n")[0],
        "",
    ]
    if subcommands(command):
        names = ", ".join(f"`{n}`" for n in subcommands(command))
        lines += [f"Sub-commands: {names}.", ""]
        return "\n".join(lines)
    rows = ["| argument or option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for param in command.params:
        if param.param_type_name == "option":
            names = ", ".join(f"`{o}`" for o in param.opts)
            if param.secondary_opts:
                names += ", " + ", ".join(f"`{o}`" for o in param.secondary_opts)
        else:
            names = f"`{(param.name or '').upper()}`"
        kind = "flag" if getattr(param, "is_flag", False) else _type_name(param, ctx)
        default = getattr(param.default, "value", param.default)  # enums by value
        shown = "" if default in (None, False, ()) or callable(default) else f"`{default}`"
        kind = kind.replace("|", " / ").replace("list[str]", "str")
        if getattr(param, "multiple", False):
            kind += ", repeatable"
        help_text = getattr(param, "help", None) or ""
        help_text = " ".join(help_text.split()).replace("|", "\\|")
        rows.append(f"| {names} | {kind} | {shown} | {help_text} |")
    rows.append("| `--help` | flag | | Show the help and exit. |")
    return "\n".join(lines + rows)


# --------------------------------------------------------------------------
# The directives
# --------------------------------------------------------------------------


def expand(markdown: str, page_src: str) -> str:
    """``markdown`` with every kvpool directive replaced by its generated content."""

    def replace(match: re.Match[str]) -> str:
        kind, args = match.group(1), match.group(2).split()
        if kind == "picture":
            return expand_picture(page_src, *args)
        if kind == "scenario":
            return expand_scenario(page_src, *args)
        if kind == "scenarios":
            return expand_scenarios()
        if kind == "operation":
            return expand_operation(*args)
        if kind == "invariants":
            return expand_invariants()
        if kind == "event-invariants":
            return expand_invariants(event_invariants())
        if kind == "profiles":
            return expand_profiles()
        if kind == "errors":
            return expand_errors()
        if kind == "cli":
            return expand_cli(" ".join(["kvpool", *args]))
        raise ValueError(f"{page_src}: unknown directive kvpool:{kind}")

    return DIRECTIVE.sub(replace, HOST_NOTE.sub("", markdown))


# --------------------------------------------------------------------------
# MkDocs entry points
# --------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, svg in all_pictures().items():
        files.append(File.generated(config, path, content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri)
