"""Event-consumer vectors: batches of KV events, and the scores the engines' holdings give.

A vector is a consumer test any router index can replay without Python:
its event semantics, the number of workers and the block size, then steps:
``apply_events`` (one worker's batch, oldest first), ``scores`` (a query
and, per worker, how many leading blocks that engine held at that moment)
and ``remove_worker``. ``known`` records the outcome on named consumers
(``model``, ``dynamo``, ``dynamo:raw``): CI replays the corpus on each and
requires exactly that outcome.

Files are untrusted input: each is read whole up to ``MAX_FILE_BYTES``, each
line parsed with ``json`` and checked against
``schemas/event-vectors-v1.json`` (which bounds every array), then against
what the schema cannot say (worker numbers, one score per worker, one hash
per full block). Problems name the file, the line and the field. Nothing is
evaluated. The committed corpus is in ``event-data/``
(``kvpool.specs.vectors.event_corpus`` writes it); docs/formats.md describes
the format.
"""

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvpool.model import EVENT_SEMANTICS
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.events.machine import scores_problem, show_events
from kvpool.specs.events.target import ConsumerConfig, ConsumerFactory, RemovesWorkers
from kvpool.specs.protocol import codec
from kvpool.specs.protocol.codec import Json, ProtocolError, loads
from kvpool.specs.protocol.consumer import decode_query
from kvpool.specs.vectors.format import LoadedVector, VectorFormatError, load_schema, sha256

FORMAT = "kvpool-event-vectors"
FORMAT_VERSION = 1
GENERATOR = "kvpool.specs.vectors.event_corpus"
MANIFEST = "manifest.json"
MAX_FILE_BYTES = 32 * 1024 * 1024
MAX_LINE_BYTES = 4 * 1024 * 1024
VERDICTS = ("match", "mismatch", "target error")


def bundled_event_corpus() -> Path:
    """The event-consumer corpus shipped inside the kvpool package."""
    return Path(str(resources.files("kvpool.specs.vectors").joinpath("event-data")))


def validators() -> tuple[Any, Any]:
    """JSON Schema validators for one event vector and for its manifest."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    schemas = [load_schema(n) for n in ("protocol-v1.json", "consumer-v1.json")]
    vectors = load_schema("event-vectors-v1.json")
    registry: Registry[Any] = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s)) for s in (*schemas, vectors)]
    )
    vector = Draft202012Validator(vectors, registry=registry)
    manifest = Draft202012Validator(
        {"$defs": vectors["$defs"], "$ref": "#/$defs/manifest"}, registry=registry
    )
    return vector, manifest


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


def load(path: Path, max_errors: int = 20) -> list[LoadedVector]:
    """Read and validate event vectors from a directory with a manifest, or one .jsonl file.

    Raises VectorFormatError listing every problem (file, line and field).
    """
    validator, manifest_validator = validators()
    problems: list[str] = []
    if path.is_dir():
        files = _manifest_files(path, manifest_validator, problems)
    elif path.is_file():
        files = [(path, None)]
    else:
        raise VectorFormatError(f"{path}: no such file or directory")
    loaded: list[LoadedVector] = []
    for file, count in files:
        text = _read(file, problems)
        if text is None:
            continue
        lines = text.splitlines()
        present = sum(1 for x in lines if x.strip())
        if count is not None and count != present:
            problems.append(f"{file.name}: the manifest says {count} vectors, the file {present}")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{file.name} line {number}"
            value = _parse(line, where, problems)
            if value is None:
                continue
            errors = _schema_errors(validator, value, where) or _meaning_errors(value, where)
            if errors:
                problems.extend(errors)
            else:
                loaded.append(LoadedVector(file.name, number, value))
            if len(problems) >= max_errors:
                break
        if len(problems) >= max_errors:
            break
    if problems:
        shown = problems[:max_errors]
        more = len(problems) - len(shown)
        raise VectorFormatError(
            "\n".join(shown) + (f"\n... and {more} more problem(s)" if more > 0 else "")
        )
    return loaded


def _read(file: Path, problems: list[str]) -> str | None:
    try:
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            problems.append(f"{file.name}: {size} bytes, more than the {MAX_FILE_BYTES} allowed")
            return None
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"{file.name}: cannot read: {error}")
        return None


def _parse(line: str, where: str, problems: list[str]) -> Json:
    if len(line) > MAX_LINE_BYTES:
        problems.append(f"{where}: longer than {MAX_LINE_BYTES} characters")
        return None
    try:
        value = loads(line)
    except ProtocolError as error:
        problems.append(f"{where}: {str(error)[:200]}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{where}: a vector is a JSON object")
        return None
    return value


def _schema_errors(validator: Any, value: Json, where: str) -> list[str]:
    found = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))[:5]:
        path = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        message = error.message if len(error.message) <= 300 else error.message[:297] + "..."
        found.append(f"{where}: field {path}: {message}")
    return found


def _meaning_errors(vector: dict[str, Json], where: str) -> list[str]:
    """What the schema cannot say: workers in range, one score each, one hash per full block."""
    workers = vector["config"]["num_workers"]
    size = vector["config"]["block_size"]
    found = []
    for i, step in enumerate(vector["steps"]):
        at = f"{where}: field steps/{i}"
        if "worker" in step and step["worker"] >= workers:
            found.append(f"{at}/worker: {step['worker']} is not one of 0..{workers - 1}")
        if step["op"] == "scores":
            if len(step["expect"]) != workers:
                found.append(f"{at}/expect: {len(step['expect'])} scores for {workers} workers")
            query = step["query"]
            if len(query["block_hashes"]) != len(query["token_ids"]) // size:
                found.append(
                    f"{at}/query: {len(query['block_hashes'])} hashes for "
                    f"{len(query['token_ids']) // size} full blocks"
                )
            if any(n > len(query["block_hashes"]) for n in step["expect"]):
                found.append(f"{at}/expect: a score above the query's number of blocks")
    return found


def _manifest_files(
    directory: Path, validator: Any, problems: list[str]
) -> list[tuple[Path, int | None]]:
    manifest_path = directory / MANIFEST
    try:
        with manifest_path.open("rb") as stream:
            manifest = loads(stream.read(MAX_LINE_BYTES))
    except FileNotFoundError:
        raise VectorFormatError(f"{manifest_path}: missing (a directory needs one)") from None
    except (OSError, ProtocolError) as error:
        raise VectorFormatError(f"{manifest_path}: not a JSON manifest: {error}") from error
    errors = _schema_errors(validator, manifest, MANIFEST)
    if errors:
        raise VectorFormatError("\n".join(errors))
    files: list[tuple[Path, int | None]] = []
    for entry in manifest["files"]:
        file = directory / entry["name"]
        try:
            data = file.read_bytes() if file.stat().st_size <= MAX_FILE_BYTES else b""
        except OSError as error:
            problems.append(f"{MANIFEST}: lists {entry['name']}, which cannot be read: {error}")
            continue
        if sha256(data) != entry["sha256"]:
            problems.append(
                f"{entry['name']}: sha256 {sha256(data)} does not match the manifest's "
                f"{entry['sha256']}"
            )
            continue
        files.append((file, int(entry["count"])))
    if sum(entry["count"] for entry in manifest["files"]) != manifest["count"]:
        problems.append(f"{MANIFEST}: count {manifest['count']} is not the sum of the files'")
    return files


# --------------------------------------------------------------------------
# Replaying
# --------------------------------------------------------------------------


@dataclass
class Mismatch:
    """Where a consumer parts from a vector."""

    vector: str
    where: str
    step: int
    """1-based."""
    problem: str

    def describe(self) -> str:
        return f"{self.where} {self.vector}: step {self.step}: {self.problem}"


class NeedsRemoveWorker(Exception):
    """The vector removes a worker and the consumer cannot."""


def config_of(vector: LoadedVector) -> ConsumerConfig:
    """The consumer configuration a vector is for."""
    data = vector.data
    return ConsumerConfig(
        data["config"]["num_workers"],
        data["config"]["block_size"],
        EVENT_SEMANTICS[data["event_semantics"]],
    )


def run_vector(factory: ConsumerFactory, vector: LoadedVector) -> Mismatch | None:
    """Replay one vector on a fresh consumer; None if every score matches.

    The consumer's exceptions and malformed scores raise TargetError; a
    vector that removes a worker raises NeedsRemoveWorker on a consumer
    without ``remove_worker``.
    """
    data = vector.data
    config = config_of(vector)
    vid = str(data["id"])
    consumer = _guard("building the consumer", lambda: factory(config))
    for number, step in enumerate(data["steps"], 1):
        op = step["op"]
        if op == "apply_events":
            events = [codec.decode_event(e) for e in step["events"]]
            worker = step["worker"]
            _guard(
                f"step {number}, apply_events(worker={worker}, {show_events(events)})",
                lambda: consumer.apply_events(worker, events),  # noqa: B023  (called at once)
            )
        elif op == "remove_worker":
            if not isinstance(consumer, RemovesWorkers):
                raise NeedsRemoveWorker(vid)
            worker = step["worker"]
            _guard(
                f"step {number}, remove_worker({worker})",
                lambda: consumer.remove_worker(worker),  # noqa: B023  (called at once)
            )
        else:
            problem = _score_problem(consumer, step, number, config.num_workers)
            if problem is not None:
                return Mismatch(vid, vector.where, number, problem)
    return None


def _score_problem(
    consumer: Any, step: Mapping[str, Json], number: int, workers: int
) -> str | None:
    try:
        query = decode_query(step["query"])
    except ProtocolError as error:  # the schema let it through: a hash that is not hex
        raise VectorFormatError(f"step {number}: {error}") from error
    scores = _guard(f"step {number}, scores", lambda: consumer.scores(query))
    shape = scores_problem(scores, workers, len(query.block_hashes))
    if shape is not None:
        raise TargetError(f"step {number}: the consumer answers garbage: {scores!r}: {shape}")
    said = [int(scores.get(w, 0)) for w in range(workers)]
    expected = list(step["expect"])
    if said == expected:
        return None
    parts = []
    for w, (want, got) in enumerate(zip(expected, said, strict=True)):
        if got > want:
            parts.append(f"worker {w}: scored {got}, holds {want} (a phantom hit)")
        elif got < want:
            parts.append(f"worker {w}: scored {got}, holds {want} (a missed hit)")
    return f"scores({step['query']['token_ids']}): " + "; ".join(parts)


def _guard(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except (TargetError, TargetAbort):
        raise
    except Exception as error:  # the consumer's own failure: a target error, not a kit crash
        raise TargetError(f"the consumer raised {error!r} during {what}") from error


@dataclass
class RunResult:
    """The outcome of replaying event vectors on one consumer."""

    run: int = 0
    passed: int = 0
    skipped: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    target_errors: list[str] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)
    """Vector id to ``match``, ``mismatch`` or ``target error``."""
    unexpected: list[str] = field(default_factory=list)
    """Vectors whose outcome differs from the one ``known`` records for this target."""


def run_corpus(
    factory: ConsumerFactory,
    vectors: Sequence[LoadedVector],
    target: str | None = None,
    semantics: Sequence[str] | None = None,
    fail_fast: bool = False,
) -> RunResult:
    """Replay every vector (of the chosen event semantics); count what happened.

    A consumer error ends only its vector. With ``target``, each outcome is
    compared with the one the vector records for that target string, if any.
    """
    result = RunResult()
    for vector in vectors:
        data = vector.data
        if semantics is not None and data["event_semantics"] not in semantics:
            result.skipped += 1
            continue
        vid = str(data["id"])
        try:
            mismatch = run_vector(factory, vector)
        except NeedsRemoveWorker:
            result.skipped += 1
            continue
        except TargetError as error:
            outcome = "target error"
            result.target_errors.append(f"{vector.where} {vid}: {error}")
        except TargetAbort as abort:
            result.target_errors.append(f"{vector.where} {vid}: {abort.error}")
            result.outcomes[vid] = "target error"
            result.run += 1
            break
        else:
            outcome = "match" if mismatch is None else "mismatch"
            if mismatch is not None:
                result.mismatches.append(mismatch)
        result.run += 1
        result.outcomes[vid] = outcome
        if outcome == "match":
            result.passed += 1
        known: Mapping[str, str] = data.get("known", {})
        if target is not None and target in known and known[target] != outcome:
            result.unexpected.append(f"{vid}: recorded {known[target]}, now {outcome}")
        if fail_fast and outcome != "match":
            break
    return result


def dump_line(vector: Mapping[str, Json]) -> str:
    """A vector as one line of a .jsonl file (compact, keys in a fixed order)."""
    return json.dumps(vector, separators=(",", ":"))
