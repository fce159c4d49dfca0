"""The ``kvpool`` command line.

Exit codes of ``kvpool check`` are a contract (``ConformanceReport.exit_code``):
0 programs ran and the target conforms, 1 it diverges from the model, 2 no
verdict (the command or the target could not be run, nothing ran, the target
exited, hung or was flaky), 130 interrupted by Ctrl-C. No traceback reaches
the user.
"""

import os
import sys
import traceback
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from hypothesis import settings as Settings
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvpool import impl
from kvpool.model import PROFILES
from kvpool.specs.checking import check as check_layer
from kvpool.specs.cli.history import history_app, record_command
from kvpool.specs.cli.vectors import vectors_app
from kvpool.specs.runner.database import (
    REDIS_URL_VARIABLE,
    DatabaseChoice,
    RedisUnavailable,
    check_redis,
    choose,
    redis_url,
)
from kvpool.specs.runner.render import print_terminal, save, to_json, to_junit
from kvpool.specs.runner.report import (
    EXIT_CONFORMS,
    EXIT_DIVERGES,
    EXIT_NO_VERDICT,
    ConformanceReport,
)
from kvpool.specs.runner.settings import PROFILE_NAMES, default_profile_name
from kvpool.specs.runner.watchdog import DEFAULT_PROGRAM_TIMEOUT
from kvpool.specs.targets import LAYERS, TargetDescriptor, TargetSpecError, resolve
from kvpool.specs.targets.registry import is_sglang_target
from kvpool.specs.targets.vllm.releases import forwarded_options, run_check_in_release
from kvpool.specs.teaching.command import explain

app = typer.Typer(
    help="kvpool: check KV-cache block pools against an executable specification.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_ERROR = EXIT_NO_VERDICT
EXIT_INTERRUPTED = 130
__all__ = ["EXIT_CONFORMS", "EXIT_DIVERGES", "EXIT_ERROR", "EXIT_INTERRUPTED", "app", "main"]

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
    examples: Annotated[
        int | None, typer.Option(min=1, max=10**9, help="Number of programs to run.")
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, max=10_000, help="Operations per program.")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=2**64 - 1,
            help="Seed: the same seed gives the same run (and no example database is used).",
        ),
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
    program_timeout: Annotated[
        float,
        typer.Option(
            min=0.001,
            max=86400,
            help="Seconds one program may run before the target counts as hung.",
        ),
    ] = DEFAULT_PROGRAM_TIMEOUT,
    database: Annotated[
        DatabaseChoice,
        typer.Option(
            help="Example database (dev, deep, fuzz profiles): auto = kvpool's own directory, "
            "and Redis too if KVPOOL_REDIS_URL names a usable one; local; redis (a Redis "
            "problem stops the run); none."
        ),
    ] = DatabaseChoice.AUTO,
    shrink: Annotated[
        bool,
        typer.Option(
            help="Shrink a failing program to a minimal one (--no-shrink: show it as found; "
            "the verdict comes as soon as the failure, the program is longer)."
        ),
    ] = True,
) -> None:
    """Run the lock-step state machine against a target and report conformance.

    Exit codes: 0 programs ran and the target conforms; 1 it diverges from the
    model; 2 no verdict (the target or the command could not be run); 130
    interrupted (Ctrl-C).
    """
    console = Console(stderr=report_format is not ReportFormat.terminal)
    chosen_profile = hypothesis_profile or default_profile_name()
    if chosen_profile not in PROFILE_NAMES:
        _stop(
            console,
            f"unknown Hypothesis profile {chosen_profile!r}: use {', '.join(PROFILE_NAMES)}",
        )
    if layer is None:
        layer = "radix" if target is not None and is_sglang_target(target) else "pool"
    layer = LAYER_ALIASES.get(layer, layer)
    if layer not in LAYERS:
        _stop(console, f"unknown layer {layer!r}: use {', '.join(LAYERS)}")
    if output is not None:
        problem = _unwritable(output)
        if problem is not None:
            _stop(console, f"--output {output}: {problem}")
    problem = _not_a_directory(regression_dir)
    if problem is not None:
        _stop(console, f"--regression-dir {regression_dir}: {problem}")
    if target is not None and not target.strip():
        _stop(console, "the target string is empty")
    target = target or DEFAULT_TARGETS[layer]
    try:
        descriptor = resolve(layer, target)
    except TargetSpecError as error:
        _stop(console, str(error))
    if descriptor.in_child:
        # vllm==X.Y.Z: the same command, in a child interpreter that imports release X.Y.Z
        assert descriptor.release is not None
        code = run_check_in_release(target, forwarded_options(ctx))
        raise typer.Exit(code if code in (0, 1, 2, EXIT_INTERRUPTED) else EXIT_ERROR)
    _choose_database(console, database, chosen_profile, seed)

    try:
        report = _run_with_progress(
            console,
            descriptor,
            level,
            profile,
            chosen_profile,
            examples,
            steps,
            seed,
            program_timeout,
            shrink,
        )
    except KeyboardInterrupt:
        _close(descriptor)
        console.print("[yellow]interrupted: no verdict[/yellow]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except RedisUnavailable as problem:
        _close(descriptor)
        _stop(console, f"{problem} (--database redis: stopped before running)")
    finally:
        _close(descriptor)
    if target.split(":")[0] == "impl":
        report.notes.append(impl_build())
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
            try:
                output.write_text(text)
            except OSError as error:
                console.print(f"cannot write the report to {output}: {error}", markup=False)
                raise typer.Exit(EXIT_ERROR) from None
        else:
            typer.echo(text)
    raise typer.Exit(report.exit_code)


def _stop(console: Console, message: str) -> NoReturn:
    """Exit 2 with ``message`` (the caller's mistake or an unusable setting: nothing ran)."""
    console.print(f"kvpool: {message}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_ERROR)


def _unwritable(path: Path) -> str | None:
    """Why a report cannot be written to ``path``, or None if it can."""
    if path.is_dir():
        return "is a directory"
    parent = path.parent
    if not parent.is_dir():
        return f"the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"the directory {parent} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable"
    return None


def _not_a_directory(path: Path) -> str | None:
    """Why regression files cannot be written under ``path`` (created if missing), or None."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return "no part of it exists"
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


def _choose_database(
    console: Console, choice: DatabaseChoice, profile: str, seed: int | None
) -> None:
    """Check Redis before the run: one line and the local database, or exit 2 for ``redis``."""
    uses_database = seed is None and Settings.get_profile(profile).database is not None
    if choice is DatabaseChoice.REDIS and redis_url() is None:
        _stop(console, f"--database redis needs {REDIS_URL_VARIABLE} (a redis:// URL)")
    if uses_database and choice in (DatabaseChoice.AUTO, DatabaseChoice.REDIS):
        problem = check_redis()
        if problem is not None:
            if choice is DatabaseChoice.REDIS:
                _stop(console, f"{problem} (--database redis: stopped before running)")
            console.print(
                f"kvpool: {problem}; using the local example database only",
                style="yellow",
                markup=False,
                highlight=False,
            )
            choice = DatabaseChoice.LOCAL
    choose(choice)


def _close(descriptor: TargetDescriptor) -> None:
    """Stop the target's processes, if it has any (cmd: targets)."""
    close = getattr(descriptor.factory, "close", None)
    if close is not None:
        close()


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
    program_timeout: float,
    shrink: bool,
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
        task = progress.add_task("check", total=total, target=escape(descriptor.spec))
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
                program_timeout=program_timeout,
                shrink=shrink,
                on_example=lambda n: progress.update(task, completed=min(n, total)),
            )
        except TargetSpecError as error:
            _stop(console, str(error))


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
    """Console entry point: no traceback reaches the user; exit codes 0, 1, 2 or 130."""
    try:
        app(prog_name=os.environ.get("KVPOOL_PROG", "kvpool"))
    except KeyboardInterrupt:
        print("kvpool: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:  # a bug in kvpool: one paragraph, exit 2
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        print(
            f"kvpool: internal error: {type(error).__name__}: {error}{where}. No verdict. "
            "This is a bug in kvpool; please report it with the command you ran.",
            file=sys.stderr,
        )
        sys.exit(EXIT_ERROR)
