"""``kvpool vectors ... --layer request``: the request layer's vectors and the hash vectors."""

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kvpool.model import InvalidConfig
from kvpool.model.profiles import profile_named
from kvpool.specs.checking import replay_request_vectors
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.targets import TargetSpecError, resolve
from kvpool.specs.vectors.format import VectorFormatError, bundled_corpus, count_valid, load
from kvpool.specs.vectors.request_generate import export_request_corpus
from kvpool.specs.vectors.request_replay import RequestRunResult

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def export_request(directory: Path) -> None:
    """Write the request layer's corpus into ``directory``."""
    console = Console()
    try:
        manifest = export_request_corpus(directory)
    except OSError as error:
        console.print(f"[red]cannot write the vectors to {directory}:[/red] {error}")
        raise typer.Exit(EXIT_ERROR) from None
    console.print(
        f"wrote {manifest['count']} request-layer vectors in {len(manifest['files'])} files "
        f"to {directory}"
    )


def validate_request(path: Path) -> None:
    """Check request-layer vectors against their schema and manifest."""
    console = Console()
    try:
        count = count_valid(path, layer="request")
    except VectorFormatError as error:
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    console.print(f"{count} valid request-layer vectors in {path}", markup=False, highlight=False)


def run_request(
    path: Path | None,
    target: str,
    level: list[int] | None,
    profile: list[str] | None,
    fail_fast: bool,
) -> None:
    """Replay request-layer vectors on a target: manager vectors in its scope, hash vectors on
    a kvpool hasher. Exit 0: vectors ran and all match; 1: a mismatch; 2: cannot run, or
    nothing ran."""
    console = Console()
    source = path or bundled_corpus("request")
    factory: Any = None
    for name in profile or ():
        try:
            profile_named(name)
        except InvalidConfig as error:
            console.print(f"kvpool: {error}", style="red", markup=False, highlight=False)
            raise typer.Exit(EXIT_ERROR) from None
    try:
        vectors = load(source, layer="request")
        descriptor = resolve("request", target)
        factory = descriptor.factory
        result = replay_request_vectors(
            descriptor, vectors, levels=level, profiles=profile, fail_fast=fail_fast
        )
    except VectorFormatError as error:
        console.print(f"[red]invalid vectors[/red] in {source}:")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    except (TargetSpecError, TargetError, TargetAbort) as error:
        shown = error.error if isinstance(error, TargetAbort) else error
        console.print(f"[red]cannot run target {target!r}:[/red]")
        console.print(str(shown), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        close = getattr(factory, "close", None)
        if close is not None:
            close()
    _report(console, result, target, source)


def _report(console: Console, result: RequestRunResult, target: str, source: Path) -> None:
    for mismatch in result.mismatches[:10]:
        console.rule(f"[red]{mismatch.vector}[/red]")
        console.print(mismatch.describe(), markup=False, highlight=False)
    if result.failed > 10:
        console.print(f"... and {result.failed - 10} more mismatching vectors")
    if result.target_error is not None:
        console.rule("[red]target error[/red]")
        console.print(result.target_error, markup=False, highlight=False)
    if result.skipped_why:
        why = ", ".join(f"{n} ({what})" for what, n in sorted(result.skipped_why.items()))
        console.print(f"skipped: {why}", markup=False, highlight=False)
    console.print(
        f"{target}: {result.passed} passed, {result.failed} failed, {result.skipped} skipped "
        f"({result.run} run from {source})",
        markup=False,
        highlight=False,
    )
    if result.target_error is not None:
        raise typer.Exit(EXIT_ERROR)
    if result.run == 0:
        console.print(
            "kvpool: no vector ran, so nothing was checked: none is in the target's levels, "
            "profiles and scope",
            style="red",
            markup=False,
            highlight=False,
        )
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_MISMATCH if result.failed else EXIT_OK)
