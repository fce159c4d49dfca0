"""The vector file format: reading untrusted vector files against their schema and manifest.

A corpus is a directory of JSON-lines files and a ``manifest.json`` naming
each file with its vector count and sha256; the schema sits beside this
module (``schemas/vectors-v1.json``, which refers to the protocol's schema).
Nothing in a file is evaluated: it is parsed with ``json`` and checked by
the schema. docs/formats.md describes the format.
"""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from kvpool.specs.protocol.codec import Json, ProtocolError, loads

FORMAT = "kvpool-vectors"
FORMAT_VERSION = 1
"""The vector format; bumped on any change a consumer could notice (docs/formats.md)."""
GENERATOR = "kvpool.specs.vectors"
GENERATOR_VERSION = 1
"""Bumped whenever generate() produces a different corpus."""
MANIFEST = "manifest.json"


REQUEST_FORMAT = "kvpool-request-vectors"


def bundled_corpus(layer: str = "pool") -> Path:
    """The corpus of ``layer`` shipped inside the kvpool package: the pool's in ``data/``,
    the request layer's in ``data/request/``."""
    data = resources.files("kvpool.specs.vectors").joinpath("data")
    return Path(str(data if layer == "pool" else data.joinpath(layer)))


def sha256(data: bytes) -> str:
    """The hex sha256 of ``data``, as the manifest records it."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------
# Reading vectors: untrusted data, parsed with json and checked by the schema
# --------------------------------------------------------------------------


class VectorFormatError(ValueError):
    """Vectors or a manifest that do not follow the format; the message names file and line."""


@dataclass(frozen=True)
class LoadedVector:
    """A vector read from ``source`` (file name) at ``line`` (1-based)."""

    source: str
    line: int
    data: dict[str, Json]

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


SCHEMAS = {
    "protocol-v1.json": "kvpool.specs.protocol",
    "vectors-v1.json": "kvpool.specs.vectors",
    "consumer-v1.json": "kvpool.specs.protocol",
    "event-vectors-v1.json": "kvpool.specs.vectors",
    "request-protocol-v1.json": "kvpool.specs.protocol",
    "request-vectors-v1.json": "kvpool.specs.vectors",
    "history-v1.json": "kvpool.specs.protocol",
}
"""Each JSON Schema kvpool ships, and the package it sits beside (in ``schemas/``)."""


def load_schema(name: str) -> dict[str, Json]:
    """The JSON Schema ``name`` (a key of ``SCHEMAS``), as shipped in the package."""
    text = resources.files(SCHEMAS[name]).joinpath("schemas", name).read_text()
    schema: dict[str, Json] = json.loads(text)
    return schema


def validators(layer: str = "pool") -> tuple[Any, Any]:
    """JSON Schema validators for one vector of ``layer`` and for its manifest."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    names = ["protocol-v1.json", "vectors-v1.json"]
    if layer == "request":
        names = ["protocol-v1.json", "request-protocol-v1.json", "request-vectors-v1.json"]
    schemas = [load_schema(name) for name in names]
    vectors_schema = schemas[-1]
    registry: Registry[Any] = Registry().with_resources(
        [(schema["$id"], Resource.from_contents(schema)) for schema in schemas]
    )
    vector = Draft202012Validator(vectors_schema, registry=registry)
    manifest = Draft202012Validator(
        {"$defs": vectors_schema["$defs"], "$ref": "#/$defs/manifest"}, registry=registry
    )
    return vector, manifest


def _schema_errors(validator: Any, value: Json, where: str) -> list[str]:
    problems = []
    found = [e for error in validator.iter_errors(value) for e in _innermost(error)]
    for error in sorted(found, key=lambda e: [str(p) for p in e.absolute_path]):
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        problems.append(f"{where}: field {path}: {_short(error.message)}")
    return problems


def _innermost(error: Any) -> list[Any]:
    """For a value that fits none of a ``oneOf``'s kinds (a manager vector, a hash vector),
    the errors of the kind it came closest to (the fewest errors, then the deepest), so the
    report names the field, not the whole vector."""
    if not error.context:
        return [error]
    branches: dict[Any, list[Any]] = {}
    for inner in error.context:
        branches.setdefault(inner.relative_schema_path[0], []).append(inner)
    closest = min(
        branches.values(), key=lambda es: (len(es), -max(len(e.absolute_path) for e in es))
    )
    return [e for inner in closest for e in _innermost(inner)]


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:297] + "..."


MAX_LINE = 16 * 1024 * 1024
"""Bytes one vector line may have."""
MAX_MANIFEST = 1024 * 1024
"""Bytes a manifest may have."""


def load(path: Path, max_errors: int = 20, layer: str = "pool") -> list[LoadedVector]:
    """Read and validate vectors from a directory with a manifest, or from one .jsonl file.

    Raises VectorFormatError listing every problem (file, line and field).
    ``layer`` names the format (``pool`` or ``request``). Holds every vector
    in memory: ``scan`` streams them instead.
    """
    return list(scan(path, max_errors, layer))


def count_valid(path: Path, max_errors: int = 20, layer: str = "pool") -> int:
    """How many vectors ``path`` holds, all validated; VectorFormatError as ``load``. Streams."""
    return sum(1 for _ in scan(path, max_errors, layer))


def scan(path: Path, max_errors: int = 20, layer: str = "pool") -> Iterator[LoadedVector]:
    """The valid vectors of ``path``, one at a time, as they are read.

    Memory stays bounded whatever the corpus size, and each byte is read a
    bounded number of times (once for the manifest's checksum, once to parse).
    After the last vector, or as soon as ``max_errors`` problems are found,
    raises VectorFormatError listing them; a consumer that must not act on a
    corpus with problems collects first (``load``).
    """
    validator, manifest_validator = validators(layer)
    problems: list[str] = []
    if path.is_dir():
        files = _manifest_files(path, manifest_validator, problems)
    elif path.exists():  # a file, or a pipe (/dev/stdin)
        files = [(path, None)]
    else:
        raise VectorFormatError(f"{path}: no such file or directory")
    for file, count in files:
        found = 0
        try:
            stream = file.open("rb")
        except OSError as error:
            problems.append(f"{file.name}: cannot read: {error}")
            continue
        with stream:
            for number, raw in enumerate(_lines(stream), 1):
                if len(problems) >= max_errors:
                    break
                where = f"{file.name} line {number}"
                if raw is None:
                    problems.append(f"{where}: longer than {MAX_LINE} bytes")
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    problems.append(f"{where}: not UTF-8: {error}")
                    continue
                if not line.strip():
                    continue
                found += 1
                try:
                    value = loads(line)
                except ProtocolError as error:
                    problems.append(f"{where}: {error}")
                    continue
                errors = (
                    [] if validator.is_valid(value) else _schema_errors(validator, value, where)
                )
                if errors:
                    problems.extend(errors)
                elif not problems:
                    yield LoadedVector(file.name, number, value)
        if count is not None and count != found and len(problems) < max_errors:
            problems.append(f"{file.name}: the manifest says {count} vectors, the file has {found}")
        if len(problems) >= max_errors:
            break
    if problems:
        shown = problems[:max_errors]
        more = len(problems) - len(shown)
        raise VectorFormatError(
            "\n".join(shown) + (f"\n... and {more} more problem(s)" if more > 0 else "")
        )


def _lines(stream: BinaryIO) -> Iterator[bytes | None]:
    """The lines of ``stream`` without their newline; None for one longer than ``MAX_LINE``."""
    while True:
        line = stream.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE and not line.endswith(b"\n"):
            while (rest := stream.readline(MAX_LINE)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line.rstrip(b"\r\n")


def _file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_files(
    directory: Path, validator: Any, problems: list[str]
) -> list[tuple[Path, int | None]]:
    manifest_path = directory / MANIFEST
    try:
        with manifest_path.open("rb") as stream:
            text = stream.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise VectorFormatError(
            f"{manifest_path}: missing (a vectors directory needs one)"
        ) from None
    except OSError as error:
        raise VectorFormatError(f"{manifest_path}: cannot read: {error}") from None
    if len(text) > MAX_MANIFEST:
        raise VectorFormatError(f"{manifest_path}: larger than {MAX_MANIFEST} bytes")
    try:
        manifest = loads(text)
    except ProtocolError as error:
        raise VectorFormatError(f"{manifest_path}: not a JSON manifest: {error}") from None
    errors = _schema_errors(validator, manifest, MANIFEST)
    if errors:
        raise VectorFormatError("\n".join(errors))
    files: list[tuple[Path, int | None]] = []
    for entry in manifest["files"]:
        file = directory / entry["name"]
        try:
            digest = _file_sha256(file)
        except OSError as error:
            problems.append(f"{MANIFEST}: lists {entry['name']}, which cannot be read: {error}")
            continue
        if digest != entry["sha256"]:
            problems.append(
                f"{entry['name']}: sha256 {digest} does not match the manifest's {entry['sha256']}"
            )
            continue
        files.append((file, int(entry["count"])))
    if sum(entry["count"] for entry in manifest["files"]) != manifest["count"]:
        problems.append(
            f"{MANIFEST}: count {manifest['count']} is not the sum of the files' counts"
        )
    return files
