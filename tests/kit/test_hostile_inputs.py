"""Hostile vector files, CLI misuse and a protocol server fed garbage.

Every one ends with a named error (exit 2 from the command line), never a
traceback, within bounded time and memory; and zero vectors run is not a pass.
"""

import io
import json
import os
import threading
import tracemalloc
from pathlib import Path

import pytest

from kvpool.model import PoolConfig
from kvpool.specs import protocol
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.protocol.server import Server, serve
from kvpool.specs.vectors import VectorFormatError, count_valid, scan
from tests.kit.helpers import ROOT, assert_no_traceback, python_target, run_kvpool

CORPUS = ROOT / "specs" / "vectors" / "data"
ONE_VECTOR = (CORPUS / "scenarios.jsonl").read_text().splitlines()[0]


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _vector(**changes: object) -> str:
    data = json.loads(ONE_VECTOR)
    data.update(changes)
    return json.dumps(data)


# --------------------------------------------------------------------------
# Hostile vector files
# --------------------------------------------------------------------------

HOSTILE_VECTORS = {
    "nested-100k-deep": ("[" * 100_000 + "]" * 100_000 + "\n", "nested deeper than 32 levels"),
    "nested-within-json-limits": ("[" * 500 + "]" * 500 + "\n", "nested deeper than 32 levels"),
    "not-json": ("{oops\n", "not JSON"),
    "nan": ('{"id": NaN}\n', "NaN is not a JSON number"),
    "huge-number": ('{"id": 1e999}\n', "too large for a number"),
    "a-trillion-blocks": (
        _vector(config={**json.loads(ONE_VECTOR)["config"], "num_blocks": 10**12}) + "\n",
        "field config/num_blocks",
    ),
    "level-3": (_vector(level=3) + "\n", "field level"),
    "not-utf8": ("\udcff\n", "not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_VECTORS))
@pytest.mark.parametrize("command", ["validate", "run", "explain"])
def test_a_hostile_vector_file_is_refused_by_every_command(
    tmp_path: Path, name: str, command: str
) -> None:
    text, phrase = HOSTILE_VECTORS[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    args = ["explain", str(path)] if command == "explain" else ["vectors", command, str(path)]
    result = run_kvpool(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert phrase in output, output
    assert_no_traceback(result)
    if command == "run":
        assert "target" not in output.split("invalid vectors")[0], "blamed on the target"


def test_a_line_longer_than_the_bound_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_bytes(b" " * (17 * 2**20) + b"\n" + ONE_VECTOR.encode() + b"\n")
    with pytest.raises(VectorFormatError, match=r"long\.jsonl line 1: longer than 16777216 bytes"):
        count_valid(path)


def test_validation_streams_in_bounded_memory(tmp_path: Path) -> None:
    """Thousands of vectors are validated one at a time: memory does not grow with the file."""
    path = tmp_path / "many.jsonl"
    small = _vector(steps=[])
    with path.open("w") as f:
        for _ in range(4000):
            f.write(small + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        assert count_valid(path) == 4000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size / 2, (peak, size)


def test_vectors_are_yielded_as_they_arrive(tmp_path: Path) -> None:
    """A consumer gets the first vector before the rest of the file exists (a pipe)."""
    fifo = tmp_path / "vectors.jsonl"
    os.mkfifo(fifo)
    release = threading.Event()

    def writer() -> None:
        with fifo.open("w") as f:
            f.write(ONE_VECTOR + "\n")
            f.flush()
            release.wait(30)
            f.write(ONE_VECTOR + "\n")

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        stream = scan(fifo)
        first = next(stream)
        assert first.line == 1
        release.set()
        assert [v.line for v in stream] == [2]
    finally:
        release.set()
        thread.join(30)


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--profile", "nope"], "unknown profile(s) ['nope']"),
        (["--level", "3"], "Invalid value for '--level'"),
        (["--level", "2", "--profile", "append", "EMPTY"], "hold no vector at all"),
        (["--level", "1", "LEVEL2"], "none of the"),
    ],
)
def test_a_run_of_zero_vectors_is_exit_2_saying_why(
    tmp_path: Path, args: list[str], phrase: str
) -> None:
    empty = _file(tmp_path, "empty.jsonl", "")
    level2 = tmp_path / "level2.jsonl"
    level2.write_text(
        "".join(line + "\n" for line in (CORPUS / "walks-level2.jsonl").read_text().splitlines())
    )
    swapped = [{"EMPTY": str(empty), "LEVEL2": str(level2)}.get(a, a) for a in args]
    paths = [a for a in swapped if a.endswith(".jsonl")]
    options = [a for a in swapped if not a.endswith(".jsonl")]
    result = run_kvpool("vectors", "run", *paths, *options)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert phrase in output, output
    assert_no_traceback(result)


def test_a_target_whose_hello_misspells_a_profile_runs_no_vector() -> None:
    result = run_kvpool("vectors", "run", "--target", python_target("bad_hello"))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "unknown profile(s) ['hashles-first']" in output
    assert_no_traceback(result)


def test_an_empty_manifest_runs_nothing_and_says_so(tmp_path: Path) -> None:
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    manifest.update(count=0, files=[])
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    result = run_kvpool("vectors", "run", str(tmp_path))
    assert result.returncode == 2, result.stdout
    assert "hold no vector at all" in result.stdout + result.stderr


# --------------------------------------------------------------------------
# CLI misuse
# --------------------------------------------------------------------------


def test_output_into_a_missing_directory_stops_before_the_run(tmp_path: Path) -> None:
    result = run_kvpool(
        "check", "--format", "json", "--output", str(tmp_path / "no" / "such" / "report.json")
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "does not exist" in output and "programs run" not in output
    assert_no_traceback(result)


def test_a_regression_dir_that_is_a_file_stops_before_the_run(tmp_path: Path) -> None:
    blocker = _file(tmp_path, "file", "")
    result = run_kvpool("check", "--regression-dir", str(blocker / "sub"))
    assert result.returncode == 2
    assert "is not a directory" in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["check", "--layer", "nope"],
        ["check", "--hypothesis-profile", "nope"],
        ["check", "--examples", "0"],
        ["check", "--steps", "-1"],
        ["check", "--seed", "-5"],
        ["check", "--program-timeout", "nan"],
        ["check", "--target", ""],
        ["check", "--target", "cmd:"],
        ["check", "--target", "cmd:'unterminated"],
        ["check", "--target", "[red]markup[/red]:x"],
        ["check", "--no-such-option"],
        ["vectors", "run", "--target", "nonsense"],
        ["vectors", "validate", "/no/such/file.jsonl"],
        ["vectors", "export", "/proc/no/such/dir"],
        ["explain", "/no/such/scenario"],
    ],
)
def test_misuse_of_the_command_line_is_exit_2_without_a_traceback(args: list[str]) -> None:
    result = run_kvpool(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert_no_traceback(result)


# --------------------------------------------------------------------------
# The protocol server fed garbage
# --------------------------------------------------------------------------

GARBAGE = [
    "not json",
    "[" * 50_000 + "]" * 50_000,
    "null",
    "42",
    '"hello"',
    "[]",
    "{}",
    '{"id": "x", "op": "hello"}',
    '{"id": 1}',
    '{"id": 1, "op": 7, "args": {}}',
    '{"id": 1, "op": "get_new_blocks", "args": []}',
    '{"id": 1, "op": "get_new_blocks", "args": {"num_blocks": 1}}',
    '{"id": 1, "op": "new_pool", "args": {"num_blocks": 1000000000000}}',
    '{"id": 1, "op": "new_pool", "args": {"num_blocks": 1e400}}',
    '{"id": 1, "op": "new_pool", "args": {"num_blocks": NaN}}',
    '{"id": 1, "op": "new_pool", "args": {"num_blocks": 4, "profile": ["x"]}}',
    '{"id": 1, "op": "no_such_op", "args": {}}',
]


def test_the_protocol_server_answers_garbage_with_protocol_errors_and_goes_on() -> None:
    lines = [*GARBAGE, '{"id": 99, "op": "hello", "args": {}}']
    out = io.StringIO()
    serve(ModelTarget, io.StringIO("\n".join(lines) + "\n"), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == len(lines)
    for line, reply in zip(GARBAGE, replies[:-1], strict=True):
        assert reply["error"] == "ProtocolError", (line[:80], reply)
    assert replies[-1]["ok"]["protocol"] == protocol.PROTOCOL_VERSION


def test_the_protocol_server_reports_a_crashing_target_by_its_exception() -> None:
    class Crashing(ModelTarget):
        def get_new_blocks(self, num_blocks: int) -> list[int]:
            raise AttributeError("half-way through")

    server = Server(Crashing)
    server.handle({"id": 0, "op": "new_pool", "args": protocol.encode_config(_config())})
    reply = server.handle({"id": 1, "op": "get_new_blocks", "args": {"num_blocks": 1}})
    assert reply == {
        "id": 1,
        "error": "AttributeError",
        "message": "the target raised AttributeError: half-way through",
    }


def test_the_protocol_server_bounds_a_request_line() -> None:
    out = io.StringIO()
    serve(ModelTarget, io.StringIO("x" * (17 * 2**20) + "\n" + "{}\n"), out)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert "longer than" in first["message"]
    assert second["error"] == "ProtocolError"


def _config() -> PoolConfig:
    return PoolConfig(4)


LAYER_GARBAGE = [*GARBAGE[:11], "x" * (17 * 2**20)]
"""What no layer's protocol reads: garbage, deep nesting, numbers that are not, other values,
requests without an id or op, arguments that are not an object, a line past the bound."""


def _serve_request_layer(stdin: io.StringIO, stdout: io.StringIO) -> None:
    from kvpool.specs.protocol.request_server import serve_requests
    from kvpool.specs.request.model_target import ModelManagerTarget

    serve_requests(ModelManagerTarget, stdin, stdout)


def _serve_consumer(stdin: io.StringIO, stdout: io.StringIO) -> None:
    from kvpool.specs.events.model_target import ReferenceConsumer
    from kvpool.specs.protocol.consumer import serve_consumer

    serve_consumer(ReferenceConsumer, stdin, stdout)


@pytest.mark.parametrize(
    "serve_layer",
    [lambda i, o: serve(ModelTarget, i, o), _serve_request_layer, _serve_consumer],
    ids=["pool", "request", "events"],
)
def test_every_layers_protocol_server_answers_garbage_and_goes_on(serve_layer: object) -> None:
    lines = [*LAYER_GARBAGE, '{"id": 99, "op": "hello", "args": {}}']
    out = io.StringIO()
    serve_layer(io.StringIO("\n".join(lines) + "\n"), out)  # type: ignore[operator]
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(replies) == len(lines)
    for line, reply in zip(LAYER_GARBAGE, replies[:-1], strict=True):
        assert reply.get("error") == "ProtocolError", (line[:80], reply)
        assert reply["id"] in (None, 1), reply
    assert replies[-1]["id"] == 99 and "ok" in replies[-1], replies[-1]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--layer", "request", "--profile", "nope"], "unknown profile 'nope'"),
        (["--layer", "events", "--profile", "nope"], "unknown event semantics ['nope']"),
        (["--layer", "events", "EMPTY"], "no vector ran, so nothing was checked"),
        (["--layer", "request", "EMPTY"], "no vector ran, so nothing was checked"),
    ],
)
def test_a_run_of_zero_vectors_at_the_other_layers_is_exit_2_saying_why(
    tmp_path: Path, args: list[str], phrase: str
) -> None:
    empty = _file(tmp_path, "empty.jsonl", "")
    result = run_kvpool("vectors", "run", *(str(empty) if a == "EMPTY" else a for a in args))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert phrase in output, output
    assert_no_traceback(result)


REQUEST_CORPUS = CORPUS / "request"


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_blocks", 10**12), ("max_model_len", 10**9), ("hash_block_size", 10**6)],
)
def test_a_request_vector_asking_for_a_huge_manager_is_refused_as_data(
    tmp_path: Path, field: str, value: int
) -> None:
    """Sizes past the protocol's bounds are the vector's fault, found before anything runs."""
    data = json.loads((REQUEST_CORPUS / "scenarios.jsonl").read_text().splitlines()[0])
    data["setup"][field] = value
    path = _file(tmp_path, "huge.jsonl", json.dumps(data) + "\n")
    for command in ("validate", "run"):
        result = run_kvpool("vectors", command, str(path), "--layer", "request")
        output = result.stdout + result.stderr
        assert result.returncode == 2, output
        assert f"field setup/{field}" in output, output
        assert_no_traceback(result)


def test_the_request_codec_bounds_a_setup() -> None:
    from kvpool.model.single_type import full_attention
    from kvpool.specs.protocol.request_codec import decode_setup, encode_setup
    from kvpool.specs.request.target import ManagerSetup

    setup = encode_setup(ManagerSetup(4, (full_attention(2),), 16, 2))
    assert isinstance(setup, dict)
    for field, value in [("num_blocks", 10**12), ("specs", setup["specs"] * 17)]:
        with pytest.raises(protocol.ProtocolError, match="the protocol allows at most"):
            decode_setup({**setup, field: value})
    with pytest.raises(protocol.ProtocolError, match="unknown profile"):
        decode_setup({**setup, "profile": ["x"]})
