"""The ``kvpool`` command line.

Exit codes of ``kvpool check``: 0 the target conforms, 1 it diverges from
the model, 2 the command or the target could not be run.
"""

import dataclasses
import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated
from xml.sax.saxutils import escape

import typer
from hypothesis import settings as Settings
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool.model import PROFILES
from kvpool.specs.conformance import ConformanceReport, run_conformance
from kvpool.specs.explain import explain
from kvpool.specs.regression import print_counterexample
from kvpool.specs.regression import save as save_counterexample
from kvpool.specs.settings import PROFILE_NAMES, default_profile_name
from kvpool.specs.targets import TargetSpecError, resolve_target
from kvpool.specs.vectors import vectors_app
from kvpool.specs.vllm_releases import default_profile_for, delegate_check

app = typer.Typer(
    help="kvpool: check KV-cache block pools against an executable specification.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_CONFORMS, EXIT_DIVERGES, EXIT_ERROR = 0, 1, 2

app.add_typer(vectors_app, name="vectors")


class ReportFormat(StrEnum):
    terminal = "terminal"
    json = "json"
    junit = "junit"


@app.command()
def check(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Option(
            help="impl, model, module:factory (a callable taking a PoolConfig), "
            "cmd:PROGRAM ARGS (any language, docs/formats.md), "
            "vllm, vllm:module:Class or vllm==X.Y.Z."
        ),
    ] = "impl",
    level: Annotated[
        int, typer.Option(min=1, max=2, help="1: valid operations; 2: invalid ones too.")
    ] = 1,
    profile: Annotated[
        list[str] | None,
        typer.Option(help=f"Semantics profile the target claims: {', '.join(PROFILES)}."),
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
        str,
        typer.Option(
            help="pool: the block pool; manager: the KV cache manager (targets impl, model, vllm)."
        ),
    ] = "pool",
) -> None:
    """Run the lock-step state machine against a target and report conformance."""
    console = Console(stderr=report_format is not ReportFormat.terminal)
    chosen_profile = hypothesis_profile or default_profile_name()
    if chosen_profile not in PROFILE_NAMES:
        console.print(f"[red]unknown Hypothesis profile {chosen_profile!r}[/red]")
        raise typer.Exit(EXIT_ERROR)
    unknown = [p for p in profile or [] if p not in PROFILES]
    if unknown:
        console.print(f"[red]unknown semantics profile(s) {unknown}; known: {list(PROFILES)}[/red]")
        raise typer.Exit(EXIT_ERROR)
    if layer == "manager":
        code = _check_manager(
            console, target, chosen_profile, examples, steps, seed, report_format, output, level
        )
        raise typer.Exit(code)
    if layer != "pool":
        console.print(f"[red]unknown layer {layer!r}: use pool or manager[/red]")
        raise typer.Exit(EXIT_ERROR)
    delegated = delegate_check(target, ctx)  # vllm==X.Y.Z runs in a child interpreter
    if delegated is not None:
        raise typer.Exit(delegated)
    profile = profile or default_profile_for(target)
    try:
        factory = resolve_target(target)
    except TargetSpecError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(EXIT_ERROR) from error

    total = examples or Settings.get_profile(chosen_profile).max_examples
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
        task = progress.add_task("check", total=total, target=target)
        report = run_conformance(
            factory,
            level=level,
            profile=profile or None,
            hypothesis_profile=chosen_profile,
            max_examples=examples,
            steps=steps,
            seed=seed,
            target_name=target,
            on_example=lambda n: progress.update(task, completed=min(n, total)),
        )

    if report.counterexample is not None:
        try:
            save_counterexample(report.counterexample, regression_dir)
        except OSError as error:
            console.print(f"[yellow]cannot write the regression files: {error}[/yellow]")
    if report_format is ReportFormat.terminal:
        _print_terminal(console, report)
    else:
        text = _to_json(report) if report_format is ReportFormat.json else _to_junit(report)
        if output is not None:
            output.write_text(text)
        else:
            typer.echo(text)
    if report.failure_kind == "target-error":
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_CONFORMS if report.conforms else EXIT_DIVERGES)


@app.command()
def profiles() -> None:
    """List the semantics profiles and the vLLM releases that follow each."""
    table = Table("profile", "free order (caching on)", "free order (caching off)", "releases")
    for p in PROFILES.values():
        table.add_row(p.name, p.free_order.value, p.free_order_without_caching.value, p.releases)
    Console().print(table)


app.command(name="explain")(explain)


def _check_manager(
    console: Console,
    target: str,
    hypothesis_profile: str,
    examples: int | None,
    steps: int | None,
    seed: int | None,
    report_format: ReportFormat,
    output: Path | None,
    level: int = 1,
) -> int:
    """``kvpool check --layer manager``: the request-level machine against a manager target."""
    from kvpool.specs.manager_machine import resolve_manager_target, run_manager_conformance

    try:
        chosen = resolve_manager_target(target)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return EXIT_ERROR
    report: ConformanceReport = run_manager_conformance(
        chosen,
        hypothesis_profile=hypothesis_profile,
        max_examples=examples,
        steps=steps,
        seed=seed,
        target_name=target,
        level=level,
    )
    if report_format is ReportFormat.terminal:
        _print_terminal(console, report)
    else:
        text = _to_json(report) if report_format is ReportFormat.json else _to_junit(report)
        if output is not None:
            output.write_text(text)
        else:
            typer.echo(text)
    if report.failure_kind == "target-error":
        return EXIT_ERROR
    return EXIT_CONFORMS if report.conforms else EXIT_DIVERGES


def _print_terminal(console: Console, report: ConformanceReport) -> None:
    if not report.conforms:
        broken = report.failure_kind == "target-error"
        title = "could not be run" if broken else "diverges from the model"
        console.rule(f"[red]{report.target} {title}[/red]")
        if report.program:
            console.print("[bold]Minimal failing program:[/bold]")
            console.print(report.program, markup=False, highlight=False)
        if report.counterexample is not None:
            print_counterexample(console, report.counterexample)
        else:
            console.print(f"[bold]What went wrong ({report.failure_kind}):[/bold]")
            console.print(report.failure or "", markup=False, highlight=False)
    table = Table(title="kvpool check", show_header=False)
    table.add_row("target", report.target)
    table.add_row("level", str(report.level))
    table.add_row("semantics profile(s)", ", ".join(report.profiles))
    table.add_row("Hypothesis profile", report.hypothesis_profile)
    table.add_row("programs run", str(report.examples_run))
    table.add_row("time", f"{report.seconds:.1f} s")
    verdict = "[green]conforms[/green]" if report.conforms else "[red]diverges[/red]"
    if report.failure_kind == "target-error":
        verdict = "[red]target error[/red]"
    table.add_row("result", verdict)
    console.print(table)


def _to_json(report: ConformanceReport) -> str:
    return json.dumps(dataclasses.asdict(report), indent=2)


def _to_junit(report: ConformanceReport) -> str:
    name = escape(f"kvpool check {report.target} level {report.level}")
    failure = ""
    if not report.conforms:
        body = escape(f"{report.program or ''}\n\n{report.failure or ''}")
        failure = f'<failure message="{escape(report.failure_kind or "")}">{body}</failure>'
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuite name="kvpool" tests="1" failures="{0 if report.conforms else 1}" '
        f'time="{report.seconds:.3f}">\n'
        f'  <testcase classname="kvpool.check" name="{name}" time="{report.seconds:.3f}">'
        f"{failure}</testcase>\n</testsuite>\n"
    )


def main() -> None:
    """Console entry point."""
    app(prog_name=os.environ.get("KVPOOL_PROG", "kvpool"))
