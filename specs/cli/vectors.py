"""``kvpool vectors``: export the model's corpus, validate vector files, replay them on a target.

``--layer pool`` (the default) is the pool corpus (``kvpool.specs.vectors``);
``--layer events`` the event-consumer corpus (``kvpool.specs.vectors.events``),
replayed on a consumer (``model``, ``dynamo``, ``dynamo:raw``, ``cmd:...``,
``module:factory``); ``--layer request`` the request layer's corpus, manager
and hash vectors (``kvpool.specs.cli.request_vectors``).
"""

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from kvpool.model import EVENT_SEMANTICS, PROFILES, InvalidConfig
from kvpool.model.profiles import profile_named
from kvpool.specs.cli import request_vectors
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.pool.target import TargetFactory
from kvpool.specs.targets import TargetSpecError, resolve, resolve_target
from kvpool.specs.vectors import event_corpus
from kvpool.specs.vectors import events as event_vectors
from kvpool.specs.vectors.format import VectorFormatError, bundled_corpus, count_valid, scan
from kvpool.specs.vectors.generate import export
from kvpool.specs.vectors.replay import run_corpus

vectors_app = typer.Typer(
    help="Conformance vectors: export the model's corpus, replay it against a target.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
LAYERS = ("pool", "events", "request")

Layer = Annotated[
    str,
    typer.Option(
        help="pool: pool vectors; events: event-consumer vectors; request: the KV cache "
        "manager's vectors and the hash vectors."
    ),
]


def _layer(layer: str) -> str:
    if layer not in LAYERS:
        known = ", ".join(LAYERS)
        Console().print(f"[red]unknown layer {layer!r}: vectors exist for {known}[/red]")
        raise typer.Exit(EXIT_ERROR)
    return layer


@vectors_app.command("export")
def export_command(
    directory: Annotated[
        Path, typer.Argument(help="Where to write the .jsonl files and manifest.")
    ],
    layer: Layer = "pool",
) -> None:
    """Write the model's corpus (JSON lines and manifest.json) into DIRECTORY."""
    if _layer(layer) == "request":
        request_vectors.export_request(directory)
        return
    writer = export if _layer(layer) == "pool" else event_corpus.export
    try:
        manifest = writer(directory)
    except OSError as error:
        _stop(Console(), f"cannot write the vectors to {directory}: {error}")
    Console().print(
        f"wrote {manifest['count']} vectors in {len(manifest['files'])} files to {directory}"
    )


@vectors_app.command("validate")
def validate_command(
    path: Annotated[Path, typer.Argument(help="A vectors directory (with manifest) or a .jsonl.")],
    layer: Layer = "pool",
) -> None:
    """Check vectors against the schema and the manifest, without running anything."""
    if _layer(layer) == "request":
        request_vectors.validate_request(path)
        return
    console = Console()
    try:
        count = count_valid(path) if _layer(layer) == "pool" else len(event_vectors.load(path))
    except VectorFormatError as error:
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    console.print(f"{count} valid vectors in {path}", markup=False, highlight=False)


@vectors_app.command("run")
def run_command(
    path: Annotated[
        Path | None,
        typer.Argument(help="A vectors directory (with manifest) or a .jsonl; default: bundled."),
    ] = None,
    target: Annotated[
        str,
        typer.Option(
            help="impl, model, cmd:PROGRAM ARGS, or module:factory "
            "(events layer: a consumer, e.g. model, dynamo, dynamo:raw; request layer: also "
            "vllm and vllm:module:Class)."
        ),
    ] = "impl",
    level: Annotated[
        list[int] | None,
        typer.Option(min=1, max=2, help="Run only vectors of this level (repeatable)."),
    ] = None,
    profile: Annotated[
        list[str] | None,
        typer.Option(
            help="Run only vectors of this profile (repeatable; events layer: event semantics)."
        ),
    ] = None,
    fail_fast: Annotated[bool, typer.Option(help="Stop at the first mismatch.")] = False,
    layer: Layer = "pool",
    against_known: Annotated[
        bool,
        typer.Option(
            help="Events layer: pass when each outcome is the one the vector records for "
            "this target (known findings stay findings), instead of requiring every match."
        ),
    ] = False,
) -> None:
    """Replay vectors against a target.

    Exit 0: vectors ran and all match; 1: a mismatch; 2: cannot run, or nothing ran.
    """
    console = Console()
    if _layer(layer) == "request":
        request_vectors.run_request(path, target, level, profile, fail_fast)
    if _layer(layer) == "events":
        _run_events(console, path, target, profile, fail_fast, against_known)
    source = path or bundled_corpus()
    unknown = [p for p in profile or () if not _known_profile(p)]
    if unknown:
        _stop(console, f"unknown profile(s) {unknown}; the profiles are {', '.join(PROFILES)}")
    factory: TargetFactory | None = None
    try:
        factory = resolve_target(target)
        levels, profiles = _supported(factory, level, profile)
        result = run_corpus(factory, scan(source), levels, profiles, fail_fast)
    except VectorFormatError as error:
        console.print(f"[red]invalid vectors[/red] in {escape(str(source))}:")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    except (TargetSpecError, TargetError) as error:
        _stop(console, f"cannot run target {target!r}: {error}")
    except TargetAbort as abort:
        _stop(console, f"cannot run target {target!r}: {abort.error}")
    except KeyboardInterrupt:
        console.print("kvpool: interrupted", markup=False)
        raise typer.Exit(130) from None
    finally:
        close = getattr(factory, "close", None)
        if close is not None:
            close()
    for mismatch in result.mismatches[:10]:
        console.rule(Text(mismatch.vector, style="red"))
        console.print(mismatch.describe(), markup=False, highlight=False)
    if result.failed > 10:
        console.print(f"... and {result.failed - 10} more mismatching vectors")
    if result.target_error is not None:
        console.rule("[red]target error[/red]")
        console.print(result.target_error, markup=False, highlight=False)
    console.print(
        f"{target}: {result.passed} passed, {result.failed} failed, {result.skipped} skipped "
        f"({result.run} run from {source})",
        markup=False,
        highlight=False,
    )
    if result.target_error is not None:
        raise typer.Exit(EXIT_ERROR)
    if result.run == 0:
        _stop(
            console,
            f"no vector ran, so nothing was checked: {result.why_nothing_ran(levels, profiles)}",
        )
    raise typer.Exit(EXIT_MISMATCH if result.failed else EXIT_OK)


def _known_profile(name: str) -> bool:
    try:
        profile_named(name)
    except InvalidConfig:
        return False
    return True


def _stop(console: Console, message: str) -> NoReturn:
    console.print(f"kvpool: {message}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_ERROR)


def _supported(
    factory: TargetFactory, level: list[int] | None, profile: list[str] | None
) -> tuple[list[int] | None, list[str] | None]:
    """The levels and profiles to run: the options, within what the target declares."""
    declared_levels = getattr(factory, "levels", None)
    declared_profiles = getattr(factory, "profiles", None)
    levels = list(level) if level else None
    profiles = list(profile) if profile else None
    if declared_levels is not None:
        levels = [x for x in (levels or declared_levels) if x in declared_levels]
    if declared_profiles is not None:
        profiles = [p for p in (profiles or declared_profiles) if p in declared_profiles]
    return levels, profiles


def _run_events(
    console: Console,
    path: Path | None,
    target: str,
    semantics: list[str] | None,
    fail_fast: bool,
    against_known: bool,
) -> None:
    """``kvpool vectors run --layer events``: replay event vectors on a consumer; always exits."""
    source = path or event_vectors.bundled_event_corpus()
    target = "model" if target == "impl" else target
    unknown = [s for s in semantics or () if s not in EVENT_SEMANTICS]
    if unknown:
        _stop(console, f"unknown event semantics {unknown}; use {', '.join(EVENT_SEMANTICS)}")
    try:
        vectors = event_vectors.load(source)
        descriptor = resolve("events", target)
        if descriptor.scope.get("role") != "consumer" or descriptor.factory is None:
            raise TargetSpecError(f"{target} is an engine; vectors replay on consumers")
        if descriptor.preflight is not None:
            descriptor.preflight(1, semantics or ())
    except VectorFormatError as error:
        console.print(f"[red]invalid vectors[/red] in {source}:")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    except (TargetSpecError, TargetError, TargetAbort) as error:
        console.print(f"[red]cannot run target {target!r}:[/red]")
        console.print(str(error), markup=False, highlight=False)
        raise typer.Exit(EXIT_ERROR) from None
    result = event_vectors.run_corpus(descriptor.factory, vectors, target, semantics, fail_fast)
    close = getattr(descriptor.factory, "close", None)
    if close is not None:
        close()
    for mismatch in result.mismatches[:10]:
        console.print(mismatch.describe(), markup=False, highlight=False)
    for problem in result.target_errors[:5]:
        console.rule("[red]target error[/red]")
        console.print(problem, markup=False, highlight=False)
    for line in result.unexpected:
        console.print(f"[yellow]not as recorded:[/yellow] {line}", highlight=False)
    failed = len(result.mismatches)
    console.print(
        f"{target}: {result.passed} passed, {failed} mismatched, "
        f"{len(result.target_errors)} target error(s), {result.skipped} skipped "
        f"({result.run} run from {source})",
        highlight=False,
    )
    if result.run == 0:
        why = f"none is under the event semantics {semantics}" if semantics else "none was read"
        _stop(console, f"no vector ran, so nothing was checked: {why}")
    if against_known:
        raise typer.Exit(EXIT_MISMATCH if result.unexpected else EXIT_OK)
    if result.target_errors:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_MISMATCH if failed else EXIT_OK)
