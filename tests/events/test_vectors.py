"""Event-consumer vectors: the committed corpus, its schema, bad files, and replays."""

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.vectors import event_corpus
from kvpool.specs.vectors import events as event_vectors
from kvpool.specs.vectors.format import VectorFormatError, load_schema
from tests.events.consumers import IgnoresCleared, SetConsumer
from tests.kit.helpers import ROOT, assert_no_traceback, run_kvpool

CORPUS = ROOT / "specs" / "vectors" / "event-data"


@pytest.fixture(scope="module")
def corpus() -> list[Any]:
    return event_vectors.load(CORPUS)


def test_the_committed_corpus_is_what_the_generator_writes(tmp_path: Path) -> None:
    event_corpus.export(tmp_path)
    for name in ("manifest.json", "scenarios.jsonl"):
        assert (tmp_path / name).read_bytes() == (CORPUS / name).read_bytes(), (
            f"{name} is stale: kvpool vectors export --layer events specs/vectors/event-data "
            "(and bump GENERATOR_VERSION in specs/vectors/event_corpus.py)"
        )


def test_the_schemas_are_valid_json_schemas() -> None:
    for name in ("consumer-v1.json", "event-vectors-v1.json"):
        Draft202012Validator.check_schema(load_schema(name))


def test_the_reference_consumer_matches_every_vector(corpus: list[Any]) -> None:
    result = event_vectors.run_corpus(ReferenceConsumer, corpus, target="model")
    assert result.passed == result.run == len(corpus) > 0
    assert result.unexpected == []
    assert all(v.data["known"]["model"] == "match" for v in corpus)


def test_every_scenario_is_pinned_under_both_semantics(corpus: list[Any]) -> None:
    ids = {v.data["id"] for v in corpus}
    bases = {i.rsplit("/", 1)[0] for i in ids}
    assert ids == {f"{b}/{s}" for b in bases for s in ("multiset", "last-copy")}


def test_the_copy_vectors_pin_the_difference_between_the_semantics(corpus: list[Any]) -> None:
    by_id = {v.data["id"]: v for v in corpus}

    def removals(vector_id: str) -> int:
        steps = by_id[vector_id].data["steps"]
        return sum(
            1
            for step in steps
            if step["op"] == "apply_events"
            for event in step["events"]
            if event["type"] == "BlockRemoved"
        )

    assert removals("copies/both-evicted/multiset") == 2
    assert removals("copies/both-evicted/last-copy") == 1
    assert removals("copies/one-of-two-evicted/multiset") == 1
    assert removals("copies/one-of-two-evicted/last-copy") == 0


def test_a_set_consumer_fails_the_multiset_copy_vectors_only(corpus: list[Any]) -> None:
    result = event_vectors.run_corpus(SetConsumer, corpus)
    failed = {m.vector for m in result.mismatches}
    assert "copies/one-of-two-evicted/multiset" in failed
    assert not any(v.endswith("/last-copy") for v in failed), failed


def test_a_consumer_ignoring_cleared_fails_the_cleared_vectors(corpus: list[Any]) -> None:
    result = event_vectors.run_corpus(IgnoresCleared, corpus)
    failed = {m.vector for m in result.mismatches}
    assert failed == {"cleared/reset-prefix-cache/multiset", "cleared/reset-prefix-cache/last-copy"}


def test_the_cli_replays_and_compares_with_the_recorded_outcomes() -> None:
    result = run_kvpool("vectors", "run", "--layer", "events", "--target", "model")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "20 passed" in result.stdout
    result = run_kvpool("vectors", "validate", "--layer", "events", str(CORPUS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_producer_cannot_replay_vectors() -> None:
    result = run_kvpool("vectors", "run", "--layer", "events", "--target", "pool:impl")
    assert result.returncode == 2
    assert "replay on consumers" in result.stdout
    assert_no_traceback(result)


# --------------------------------------------------------------------------
# Malformed files: rejected against the schema, naming the line
# --------------------------------------------------------------------------


def _one_line(corpus: list[Any]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(corpus[0].data))
    return data


BAD: dict[str, tuple[Any, str]] = {
    "not-json": ("{oops", "line 2: not JSON"),
    "not-an-object": ([1, 2], "a vector is a JSON object"),
    "unknown-op": (
        lambda v: v["steps"].append({"op": "exec", "code": "import os"}),
        "field steps/",
    ),
    "bad-hash": (
        lambda v: v["steps"][0]["events"][0].update(block_hashes=["XYZ"]),
        "field steps/0",
    ),
    "worker-out-of-range": (lambda v: v["steps"][0].update(worker=5), "steps/0/worker"),
    "scores-per-worker": (
        lambda v: v["steps"][-1].update(expect=[1, 1]),
        "2 scores for 1 workers",
    ),
    "unknown-semantics": (lambda v: v.update(event_semantics="set"), "event_semantics"),
    "too-many-workers": (lambda v: v["config"].update(num_workers=100), "num_workers"),
    "verdict": (lambda v: v["known"].update(model="fine"), "known/model"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_vector_is_rejected_naming_its_line(
    case: str, corpus: list[Any], tmp_path: Path
) -> None:
    change, evidence = BAD[case]
    good = json.dumps(corpus[0].data)
    if callable(change):
        vector = _one_line(corpus)
        change(vector)
        bad = json.dumps(vector)
    else:
        bad = change if isinstance(change, str) else json.dumps(change)
    file = tmp_path / "bad.jsonl"
    file.write_text(f"{good}\n{bad}\n")
    with pytest.raises(VectorFormatError) as info:
        event_vectors.load(file)
    assert "bad.jsonl line 2" in str(info.value)
    assert evidence in str(info.value)


def test_a_line_too_long_or_too_deep_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "deep.jsonl"
    file.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(VectorFormatError, match="line 1"):
        event_vectors.load(file)


def test_a_manifest_with_a_wrong_sha256_is_refused(tmp_path: Path) -> None:
    event_corpus.export(tmp_path)
    path = tmp_path / "scenarios.jsonl"
    path.write_text(path.read_text().replace('"basics"', '"basic"', 1))
    with pytest.raises(VectorFormatError, match="sha256"):
        event_vectors.load(tmp_path)
    result = run_kvpool("vectors", "run", "--layer", "events", "--target", "model", str(tmp_path))
    assert result.returncode == 2
    assert_no_traceback(result)
