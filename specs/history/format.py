"""The history format: JSON lines, a header then one line per recorded call.

A history is what an engine's KV-cache layer did while it served: every call
its scheduler made on the manager, the pool calls made inside them (nesting
kept: ``p`` is the enclosing call, ``d`` the KV depth) and a few scheduler
markers (a step, a request added, a preemption, a finish). The names are
kvpool's, never an engine's classes, so any engine (or a router) can write
one. docs/formats.md describes it; ``specs/protocol/schemas/history-v1.json``
is its JSON Schema.

Reading is bounded and data-only: a line is at most ``MAX_LINE_BYTES``, a
history at most ``MAX_CALLS`` calls, JSON is parsed with ``json.loads`` (no
objects built, nothing evaluated or unpickled), and every problem is a
``HistoryError`` that names the line.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

FORMAT = "kvpool-history"
VERSION = 1
MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_CALLS = 5_000_000
MAX_BLOCKS = 1 << 24

ORIGINS = ("scheduler", "manager", "pool")
ATTENTIONS = ("full", "sliding_window", "chunked_local", "mamba", "other")
RETENTIONS = ("dense", "sparse")

KNOWN_RELEASES = {"vllm": ("0.32.0",)}
"""Engines whose calls carry semantics of their own release (vLLM's admission rule):
a history from another release of these is not checked. Other engines' histories
are checked on the format alone."""


class HistoryError(Exception):
    """The history cannot be checked: malformed, truncated, oversized or not expressible.

    ``line`` is 1-based (the header is line 1), or None for the file as a whole.
    """

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line
        self.reason = message


@dataclass(frozen=True)
class Group:
    """One KV cache group: an attention type over blocks of one size."""

    attention: str
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    admission_cap_blocks: int | None = None
    """At most this many blocks are counted for one request when admitting it
    (a sliding-window or chunked group's bound); None: no cap."""


@dataclass(frozen=True)
class Header:
    """What the model needs to rebuild the engine's KV cache, and where the history came from."""

    engine: dict[str, Any]
    num_blocks: int
    hash_block_size: int
    max_model_len: int
    enable_caching: bool
    groups: tuple[Group, ...]
    use_eagle: bool = False
    watermark_blocks: int = 0
    partial_hash_hits: bool = False
    retention: str = "dense"
    hashing: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    recorder: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], line: int) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise HistoryError(f"{key!r} is missing or not a {_kind_name(kind)}", line)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {
            int: "integer",
            bool: "boolean",
            str: "string",
            dict: "object",
            list: "array",
            type(None): "null",
        }.get(k, k.__name__)
        for k in kinds
    )


def _size(obj: dict[str, Any], key: str, line: int, low: int = 1, high: int = MAX_BLOCKS) -> int:
    value: int = _need(obj, key, int, line)
    if not low <= value <= high:
        raise HistoryError(f"{key}={value} is out of range [{low}, {high}]", line)
    return value


def _optional_size(obj: dict[str, Any], key: str, line: int) -> int | None:
    if obj.get(key) is None:
        return None
    return _size(obj, key, line)


def _object(obj: dict[str, Any], key: str) -> dict[str, Any]:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def parse_header(obj: Any, line: int = 1) -> Header:
    """The header line, checked field by field."""
    if not isinstance(obj, dict) or obj.get("kind") != "header":
        raise HistoryError('the first line must be the header ({"kind": "header", ...})', line)
    if obj.get("format") != FORMAT:
        raise HistoryError(f"format {obj.get('format')!r} is not {FORMAT!r}", line)
    if obj.get("version") != VERSION:
        raise HistoryError(f"history format version {obj.get('version')!r} is not {VERSION}", line)
    engine = _need(obj, "engine", dict, line)
    name = _need(engine, "name", str, line)
    version = _need(engine, "version", str, line)
    known = KNOWN_RELEASES.get(name)
    if known is not None and version.split("+", 1)[0] not in known:
        raise HistoryError(
            f"{name} {version} is not a release the checker knows ({', '.join(known)})", line
        )
    cache = _need(obj, "cache", dict, line)
    groups = []
    for raw in _need(cache, "groups", list, line):
        if not isinstance(raw, dict):
            raise HistoryError("each of cache.groups must be an object", line)
        attention = _need(raw, "attention", str, line)
        if attention not in ATTENTIONS:
            raise HistoryError(f"attention {attention!r} is not one of {ATTENTIONS}", line)
        groups.append(
            Group(
                attention=attention,
                block_size=_size(raw, "block_size", line),
                sliding_window=_optional_size(raw, "sliding_window", line),
                attention_chunk_size=_optional_size(raw, "attention_chunk_size", line),
                admission_cap_blocks=_optional_size(raw, "admission_cap_blocks", line),
            )
        )
    if not groups:
        raise HistoryError("cache.groups is empty", line)
    retention = cache.get("retention", "dense")
    if retention not in RETENTIONS:
        raise HistoryError(f"cache.retention {retention!r} is not one of {RETENTIONS}", line)
    return Header(
        engine=engine,
        num_blocks=_size(cache, "num_blocks", line, low=2),
        hash_block_size=_size(cache, "hash_block_size", line),
        max_model_len=_size(cache, "max_model_len", line),
        enable_caching=_need(cache, "enable_caching", bool, line),
        groups=tuple(groups),
        use_eagle=bool(cache.get("use_eagle", False)),
        watermark_blocks=_size(cache, "watermark_blocks", line, low=0)
        if "watermark_blocks" in cache
        else 0,
        partial_hash_hits=bool(cache.get("partial_hash_hits", False)),
        retention=retention,
        hashing=_object(obj, "hashing"),
        scheduler=_object(obj, "scheduler"),
        recorder=_object(obj, "recorder"),
        raw=obj,
    )


def _load_line(raw: bytes, line: int) -> Any:
    if len(raw) > MAX_LINE_BYTES:
        raise HistoryError(f"longer than {MAX_LINE_BYTES} bytes", line)
    if not raw.endswith(b"\n"):
        raise HistoryError("truncated (no end of line)", line)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise HistoryError(f"not JSON: {str(error)[:120]}", line) from None


def _read_line(stream: IO[bytes]) -> bytes:
    # One byte past the bound: a longer line is reported, never read whole.
    return stream.readline(MAX_LINE_BYTES + 1)


def check_call(obj: Any, index: int) -> dict[str, Any]:
    """A call line's envelope; the replay checks the rest."""
    line = index + 2
    if not isinstance(obj, dict):
        raise HistoryError("a call line must be a JSON object", line)
    if obj.get("i") != index or isinstance(obj.get("i"), bool):
        raise HistoryError(f"call number {obj.get('i')!r}; expected {index} (calls in order)", line)
    parent = obj.get("p")
    if parent is not None and (
        not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent < index
    ):
        raise HistoryError(f"parent {parent!r} is not an earlier call", line)
    depth = obj.get("d")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise HistoryError(f"depth {depth!r} is not a non-negative integer", line)
    if obj.get("o") not in ORIGINS:
        raise HistoryError(f"origin {obj.get('o')!r} is not one of {ORIGINS}", line)
    if not isinstance(obj.get("m"), str):
        raise HistoryError("'m' (the method) is missing or not a string", line)
    if not isinstance(obj.get("a"), dict):
        raise HistoryError("'a' (the arguments) is missing or not an object", line)
    if "x" in obj and not isinstance(obj["x"], str):
        raise HistoryError("'x' (the exception type) is not a string", line)
    return obj


def iter_lines(stream: IO[bytes]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for every line, bounded."""
    number = 0
    while True:
        raw = _read_line(stream)
        if not raw:
            return
        number += 1
        if number > MAX_CALLS + 1:
            raise HistoryError(f"more than {MAX_CALLS} calls", number)
        yield number, _load_line(raw, number)


@dataclass
class History:
    """A parsed history: its header and its calls, in call order."""

    header: Header
    calls: list[dict[str, Any]]


def read_history(path: Path | str) -> History:
    """Parse a history file; ``HistoryError`` (naming the line) for anything wrong with it."""
    try:
        with open(path, "rb") as stream:
            return read_stream(stream)
    except OSError as error:
        raise HistoryError(f"cannot read {path}: {error.strerror or error}") from None


def read_stream(stream: IO[bytes]) -> History:
    """Parse a history from a binary stream."""
    lines = iter_lines(stream)
    first = next(lines, None)
    if first is None:
        raise HistoryError("the history is empty (no header)", 1)
    header = parse_header(first[1])
    calls = [check_call(obj, number - 2) for number, obj in lines]
    return History(header, calls)


def write_history(path: Path | str, header: dict[str, Any], calls: list[dict[str, Any]]) -> None:
    """Write a history: the header, then one compact line per call."""
    with open(path, "w", encoding="utf-8") as out:
        out.write(json.dumps(header, sort_keys=True) + "\n")
        for call in calls:
            out.write(json.dumps(call, separators=(",", ":")) + "\n")
