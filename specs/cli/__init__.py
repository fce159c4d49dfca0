"""The ``kvpool`` command line.

Exit codes of ``kvpool check``: 0 the target conforms, 1 it diverges from
the model, 2 the command or the target could not be run.
"""

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from hypothesis import settings as Settings
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool import impl
from kvpool.model import PROFILES
from kvpool.specs.checking import check as check_layer
from kvpool.specs.cli.history import history_app, record_command
from kvpool.specs.cli.vectors import vectors_app
from kvpool.specs.runner.render import print_terminal, save, to_json, to_junit
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.settings import PROFILE_NAMES, default_profile_name
from kvpool.specs.targets import LAYERS, TargetDescriptor, TargetSpecError, resolve
from kvpool.specs.targets.registry import is_sglang_target
from kvpool.specs.targets.vllm.releases import forwarded_options, run_check_in_release
from kvpool.specs.teaching.command import explain

app = typer.Typer(
    help="kvpool: check KV-cache block pools against an executable specification.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_CONFORMS, EXIT_DIVERGES, EXIT_ERROR = 0, 1, 2

LAYER_ALIASES = {"manager": "request"}
"""Earlier names of layers, still accepted: ``--layer manager`` is the request layer."""

DEFAULT_TARGETS = {
    "pool": "impl",
    "request": "impl",
    "v0": "model",
    "events": "model",
    "radix": "model",
}

app.add_typer(vectors_app, name="vectors")
app.add_typer(history_app, name="history")
app.command(name="record")(record_command)


class ReportFormat(StrEnum):
    terminal = "terminal"
    json = "json"
    junit = "junit"


@app.command()
def check(
    ctx: typer.Context,
    target: Annotated[
        str | None,
        typer.Option(
            help="impl, model, module:factory (a callable taking the layer's setup), "
            "cmd:PROGRAM ARGS (any language, docs/formats.md), "
            "vllm, vllm:module:Class or vllm==X.Y.Z; events layer also dynamo, dynamo:raw, "
            "pool:SPEC; radix layer sglang, sglang:rust|python|legacy, sglang:module:Class, "
            "sglang==X.Y.Z. Default: impl (v0, events and radix layers: model).",
            show_default=False,
        ),
    ] = None,
    level: Annotated[
        int, typer.Option(min=1, max=2, help="1: valid operations; 2: invalid ones too.")
    ] = 1,
    profile: Annotated[
        list[str] | None,
        typer.Option(
            help=f"Semantics profile the target claims: {', '.join(PROFILES)}, "
            "each optionally +last-copy (v0 layer: the discipline, any or engine; "
            "events layer: the event semantics, multiset or last-copy, default both; "
            "radix layer: the eviction policy, lru by default)."
        ),
    ] = None,
    examples: Annotated[int | None, typer.Option(min=1, help="Number of programs to run.")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Operations per program.")] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed: the same seed gives the same run.")
    ] = None,
    hypothesis_profile: Annotated[
        str | None,
        typer.Option(help=f"Hypothesis settings: {', '.join(PROFILE_NAMES)}; default ci under CI."),
    ] = None,
    report_format: Annotated[
        ReportFormat, typer.Option("--format", help="terminal, json or junit (XML).")
    ] = ReportFormat.terminal,
    output: Annotated[
        Path | None, typer.Option(help="Write the json or junit report here instead of stdout.")
    ] = None,
    regression_dir: Annotated[
        Path, typer.Option(help="Where a divergence's regression test and vector are written.")
    ] = Path("kvpool-regression"),
    layer: Annotated[
        str | None,
        typer.Option(
            help="pool: the block pool; request: the KV cache manager over it; "
            "v0: vLLM's v0 allocator; events: a KV-event consumer (router index) or producer; "
            "radix: SGLang's radix prefix cache. Default: radix for an SGLang target, else pool.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run the lock-step state machine against a target and report conformance."""
    console = Console(stderr=report_format is not ReportFormat.terminal)
    chosen_profile = hypothesis_profile or default_profile_name()
    if chosen_profile not in PROFILE_NAMES:
        console.print(f"[red]unknown Hypothesis profile {chosen_profile!r}[/red]")
        raise typer.Exit(EXIT_ERROR)
    if layer is None:
        layer = "radix" if target is not None and is_sglang_target(target) else "pool"
    layer = LAYER_ALIASES.get(layer, layer)
    if layer not in LAYERS:
        console.print(f"[red]unknown layer {layer!r}: use {', '.join(LAYERS)}[/red]")
        raise typer.Exit(EXIT_ERROR)
    target = target or DEFAULT_TARGETS[layer]
    try:
        descriptor = resolve(layer, target)
    except TargetSpecError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(EXIT_ERROR) from error
    if descriptor.in_child:
        # vllm==X.Y.Z: the same command, in a child interpreter that imports release X.Y.Z
        assert descriptor.release is not None
        raise typer.Exit(run_check_in_release(target, forwarded_options(ctx)))

    report = _run_with_progress(
        console, descriptor, level, profile, chosen_profile, examples, steps, seed
    )
    if target.split(":")[0] == "impl":
        report.notes.append(impl_build())
        if report_format is ReportFormat.terminal:
            console.print(impl_build(), highlight=False)
    if report.counterexample is not None:
        try:
            save(report.counterexample, regression_dir)
        except OSError as error:
            console.print(f"[yellow]cannot write the regression files: {error}[/yellow]")
    if report_format is ReportFormat.terminal:
        print_terminal(console, report)
    else:
        text = to_json(report) if report_format is ReportFormat.json else to_junit(report)
        if output is not None:
            output.write_text(text)
        else:
            typer.echo(text)
    if report.failure_kind == "target-error":
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_CONFORMS if report.conforms else EXIT_DIVERGES)


def impl_build() -> str:
    """Which build of kvpool.impl this process runs (``pip install .`` compiles it when it can)."""
    if impl.COMPILED:
        return "kvpool.impl: compiled with mypyc"
    return "kvpool.impl: pure Python (not compiled)"


def _run_with_progress(
    console: Console,
    descriptor: TargetDescriptor,
    level: int,
    profile: list[str] | None,
    hypothesis_profile: str,
    examples: int | None,
    steps: int | None,
    seed: int | None,
) -> ConformanceReport:
    """The check, with a progress bar on a terminal; options that do not fit exit 2."""
    total = examples or Settings.get_profile(hypothesis_profile).max_examples
    progress = Progress(
        TextColumn("checking [bold]{task.fields[target]}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with progress:
        task = progress.add_task("check", total=total, target=descriptor.spec)
        try:
            return check_layer(
                descriptor.layer,
                descriptor,
                level=level,
                profiles=profile,
                hypothesis_profile=hypothesis_profile,
                max_examples=examples,
                steps=steps,
                seed=seed,
                on_example=lambda n: progress.update(task, completed=min(n, total)),
            )
        except TargetSpecError as error:
            console.print(f"[red]{error}[/red]")
            raise typer.Exit(EXIT_ERROR) from error


@app.command()
def profiles() -> None:
    """List the semantics profiles, the vLLM releases that follow each, and the event semantics."""
    table = Table("profile", "free order (caching on)", "free order (caching off)", "releases")
    for p in PROFILES.values():
        table.add_row(p.name, p.free_order.value, p.free_order_without_caching.value, p.releases)
    console = Console()
    console.print(table)
    semantics = Table("event semantics (profile+name)", "a BlockRemoved is published")
    semantics.add_row("multiset (default)", "per block that loses a key (every vLLM release)")
    semantics.add_row("last-copy", "when the last block under a key loses it (vllm#55092)")
    console.print(semantics)


app.command(name="explain")(explain)


def main() -> None:
    """Console entry point."""
    app(prog_name=os.environ.get("KVPOOL_PROG", "kvpool"))
