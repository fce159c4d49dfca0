"""Conformance vectors: the committed corpus is current, valid, and replays on every target."""

import json
import shutil
from pathlib import Path

import pytest

from kvpool.specs import protocol, vectors
from kvpool.specs.targets.registry import resolve_target
from kvpool.specs.vectors import VectorFormatError, generate, load, run_corpus
from tests.kit.helpers import ROOT, assert_no_traceback, node_target, run_kvpool

CORPUS = ROOT / "specs" / "vectors" / "data"


@pytest.fixture(scope="module")
def corpus() -> list[vectors.LoadedVector]:
    return load(CORPUS)


def test_the_committed_corpus_is_what_the_model_generates_now(tmp_path: Path) -> None:
    vectors.export(tmp_path)
    fresh = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in CORPUS.iterdir() if p.is_file())
    assert fresh == committed
    stale = [n for n in fresh if (tmp_path / n).read_bytes() != (CORPUS / n).read_bytes()]
    assert not stale, (
        f"specs/vectors/data is stale ({stale}): run `kvpool vectors export specs/vectors/data` "
        "and bump GENERATOR_VERSION in specs/vectors/format.py"
    )


def test_generation_is_deterministic() -> None:
    assert generate() == generate()


def test_the_corpus_covers_the_tricky_cases(corpus: list[vectors.LoadedVector]) -> None:
    tags = {t for v in corpus for t in v.data["tags"]}
    for tag in [
        "duplicate-hashes",
        "promotion",
        "eviction",
        "reset",
        "events",
        "caching-off",
        "rejections",
        "profile:hashless-first",
        "profile:append",
        "profile:hashless-first-append-uncached",
        "random-walk",
    ]:
        assert tag in tags
    errors = {s["expect"].get("error") for v in corpus for s in v.data["steps"]} - {None}
    # InvalidArgument is a wrong-typed argument: the codec refuses one before
    # any pool sees it (a ProtocolError), so no vector can expect it.
    assert errors == set(protocol.ERROR_NAMES) - {"InvalidConfig", "InvalidArgument"}
    ops = {s["op"] for v in corpus for s in v.data["steps"]}
    assert ops == set(protocol.OPERATIONS) - {"snapshot"}
    refused = [
        s
        for v in corpus
        for s in v.data["steps"]
        if s["op"] == "reset_prefix_cache" and s["expect"] == {"ok": False}
    ]
    assert refused


def test_the_corpus_replays_on_the_model(corpus: list[vectors.LoadedVector]) -> None:
    result = run_corpus(resolve_target("model"), corpus)
    assert result.run == len(corpus)
    assert result.passed == len(corpus), [m.describe() for m in result.mismatches]


def test_the_corpus_replays_on_the_impl(corpus: list[vectors.LoadedVector]) -> None:
    result = run_corpus(resolve_target("impl"), corpus)
    assert result.target_error is None
    assert result.passed == len(corpus), [m.describe() for m in result.mismatches]


def test_the_corpus_replays_on_the_node_pool_from_the_command_line() -> None:
    result = run_kvpool("vectors", "run", str(CORPUS), "--target", node_target())
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout


def test_vectors_run_reports_a_buggy_target_with_exit_code_1() -> None:
    result = run_kvpool(
        "vectors", "run", "--target", "tests.kit.buggy_pool:make_target", "--level", "1"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "scenarios.jsonl:1 basics/allocate-and-free: step 4, free_blocks" in result.stdout
    assert "-free queue (next to evict first): [2, 1, 3, 4]" in result.stdout
    assert "+free queue (next to evict first): [3, 4, 2, 1]" in result.stdout
    assert "the target's state differs from the model's" in result.stdout
    assert_no_traceback(result)


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "corpus"
    shutil.copytree(CORPUS, copy)
    return copy


def _rewrite(path: Path, line: int, change: object) -> None:
    lines = path.read_text().splitlines()
    lines[line - 1] = change(lines[line - 1])  # type: ignore[operator]
    path.write_text("\n".join(lines) + "\n")


def test_a_bad_field_is_named_with_file_line_and_path(tmp_path: Path) -> None:
    copy = tmp_path / "one.jsonl"
    shutil.copy(CORPUS / "scenarios.jsonl", copy)

    def break_it(text: str) -> str:
        vector = json.loads(text)
        vector["steps"][1]["args"]["num_blocks"] = "two"
        return json.dumps(vector)

    _rewrite(copy, 1, break_it)
    with pytest.raises(VectorFormatError) as caught:
        load(copy)
    assert "one.jsonl line 1: field steps/1/args/num_blocks: 'two' is not of type 'integer'" in (
        str(caught.value)
    )


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    copy = tmp_path / "one.jsonl"
    shutil.copy(CORPUS / "scenarios.jsonl", copy)
    _rewrite(copy, 3, lambda text: text[:-5])
    with pytest.raises(VectorFormatError, match=r"one.jsonl line 3: not JSON"):
        load(copy)


def test_a_file_that_does_not_match_its_manifest_is_refused(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    _rewrite(copy / "walks-level1.jsonl", 2, lambda text: text + " ")
    result = run_kvpool("vectors", "run", str(copy), "--target", "model")
    assert result.returncode == 2
    assert "walks-level1.jsonl: sha256" in result.stdout
    assert "does not match the manifest" in result.stdout
    assert_no_traceback(result)


def test_vectors_are_data_only(tmp_path: Path) -> None:
    """A vector that smuggles code is rejected by the schema, never run."""
    copy = tmp_path / "evil.jsonl"
    vector = json.loads((CORPUS / "scenarios.jsonl").read_text().splitlines()[0])
    vector["steps"][0]["op"] = "__import__('os').system('false')"
    copy.write_text(json.dumps(vector) + "\n")
    result = run_kvpool("vectors", "validate", str(copy))
    assert result.returncode == 2
    assert "evil.jsonl line 1: field steps/0/op" in result.stdout
    assert_no_traceback(result)


def test_export_and_validate_from_the_command_line(tmp_path: Path) -> None:
    result = run_kvpool("vectors", "export", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["format"] == "kvpool-vectors" and manifest["format_version"] == 1
    result = run_kvpool("vectors", "validate", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout
    assert f"{manifest['count']} valid vectors" in result.stdout
