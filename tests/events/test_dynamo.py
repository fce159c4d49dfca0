"""NVIDIA Dynamo's router index (ai-dynamo-runtime 1.6.1) as a consumer: adapter and verdicts.

The findings these pin are written up in docs/explanation/routers.md.
"""

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.model import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSemantics,
    KVCacheEvent,
)
from kvpool.specs.events.check import check_events
from kvpool.specs.events.engine import query_for
from kvpool.specs.events.target import ConsumerConfig
from kvpool.specs.targets import resolve
from kvpool.specs.targets.dynamo.radix_tree import (
    RELEASE,
    DedupFilter,
    DynamoConsumer,
    installed_version,
    sequence_hash,
)
from kvpool.specs.vectors import events as event_vectors
from tests.kit.helpers import ROOT, assert_no_traceback, run_kvpool

pytestmark = pytest.mark.usefixtures("require_dynamo")

CORPUS = ROOT / "specs" / "vectors" / "event-data"


def stored(*prefixes: bytes, parent: bytes | None = None, group: int = 0) -> BlockStored:
    tokens = tuple(p[-1] for p in prefixes)
    return BlockStored(prefixes, parent, tokens, 1, None, MEDIUM_GPU, None, None, group)


def removed(*prefixes: bytes) -> BlockRemoved:
    return BlockRemoved(prefixes, MEDIUM_GPU, 0)


def consumer(mode: str = "deployed", workers: int = 1) -> DynamoConsumer:
    return DynamoConsumer(ConsumerConfig(workers, 1, EventSemantics.MULTISET), mode)


A, AB, ABA = b"\x01", b"\x01\x02", b"\x01\x02\x01"


def test_the_installed_release_is_the_one_the_adapter_was_checked_against() -> None:
    assert installed_version() == RELEASE


def test_a_chain_is_scored_by_leading_blocks_per_worker() -> None:
    c = consumer(workers=2)
    c.apply_events(0, [stored(A, AB, ABA)])
    c.apply_events(1, [stored(A)])
    assert c.scores(query_for([1, 2, 1], 1)) == {0: 3, 1: 1}
    assert c.scores(query_for([2], 1)) == {0: 0, 1: 0}


def test_deployed_counts_copies_and_raw_keeps_a_set() -> None:
    events: list[KVCacheEvent] = [stored(A), stored(A), removed(A)]
    deployed, raw = consumer("deployed"), consumer("raw")
    deployed.apply_events(0, events)
    raw.apply_events(0, events)
    assert deployed.scores(query_for([1], 1)) == {0: 1}
    assert raw.scores(query_for([1], 1)) == {0: 0}


def test_the_filter_passes_a_removal_at_zero_or_of_an_untracked_hash() -> None:
    f = DedupFilter()
    f.stored([5, 5, 6])
    assert f.removed([5]) == []
    assert f.removed([5, 6, 7]) == [5, 6, 7]
    f.stored([5])
    f.cleared()
    assert f.removed([5]) == [5]


def test_other_groups_and_media_never_reach_the_tree() -> None:
    c = consumer()
    c.apply_events(0, [stored(A, group=1)])
    offloaded = BlockStored((A,), None, (1,), 1, None, "CPU", None, None, 0)
    c.apply_events(0, [offloaded])
    assert c.scores(query_for([1], 1)) == {0: 0}
    assert c.skipped["not the main group on the GPU"] == 2


def test_cleared_and_remove_worker_empty_one_worker() -> None:
    c = consumer(workers=2)
    c.apply_events(0, [stored(A)])
    c.apply_events(1, [stored(A)])
    c.apply_events(0, [AllBlocksCleared()])
    assert c.scores(query_for([1], 1)) == {0: 0, 1: 1}
    c.remove_worker(1)
    assert c.scores(query_for([1], 1)) == {0: 0, 1: 0}


def test_an_event_the_tree_refuses_is_counted_not_raised() -> None:
    c = consumer("raw")
    c.apply_events(0, [removed(A)])
    c.apply_events(0, [stored(AB, parent=A)])
    assert [r.split(": ")[-1] for r in c.rejected] == [
        "Failed to find block",
        "Failed to find parent block",
    ]
    assert "refused" in c.describe()


def test_sequence_hashes_are_64_bit_and_distinct_for_distinct_prefixes() -> None:
    values = {sequence_hash(bytes([1, 2] * n)) for n in range(1, 200)}
    assert len(values) == 199
    assert all(0 <= v < 2**64 for v in values)


@pytest.mark.parametrize("target", ["dynamo", "dynamo:raw"])
def test_the_vectors_give_the_recorded_outcome(target: str) -> None:
    vectors = event_vectors.load(CORPUS)
    factory = resolve("events", target).factory
    assert factory is not None  # an in-process target: the registry built it
    result = event_vectors.run_corpus(factory, vectors, target=target)
    assert result.unexpected == []
    assert result.target_errors == []
    assert result.run == len(vectors)
    assert all(target in v.data["known"] for v in vectors)


VERDICTS: dict[str, dict[str, str]] = {
    "dynamo": {"multiset": "diverges", "last-copy": "diverges"},
    "dynamo:raw": {"multiset": "diverges", "last-copy": "diverges"},
}


def test_the_bare_tree_diverges_under_both_semantics() -> None:
    report = check_events(resolve("events", "dynamo:raw").factory, shrink=False, max_examples=40)
    assert report.verdicts == VERDICTS["dynamo:raw"]
    assert report.claimed == ("last-copy",)


@pytest.mark.parametrize("target", ["dynamo"])
def test_kvpool_check_gives_a_verdict_per_event_semantics(target: str, tmp_path: Path) -> None:
    result = run_kvpool(
        "check", "--layer", "events", "--target", target, "--hypothesis-profile", "ci",
        "--examples", "40", "--format", "json", "--regression-dir", str(tmp_path), timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert_no_traceback(result)
    report: dict[str, Any] = json.loads(result.stdout)
    assert report["verdicts"] == VERDICTS[target]
    assert report["claimed"] == (["multiset"] if target == "dynamo" else ["last-copy"])
    saved = list(tmp_path.glob("kvpool_regression_*.jsonl"))
    assert len(saved) == 1
    assert event_vectors.load(saved[0])[0].data["known"] == {target: "mismatch"}


SURVEY: dict[tuple[str, str], tuple[str, ...]] = {
    # (target, semantics) -> engine steps left out -> what is then found
    ("dynamo", "multiset"): ("evict", "evict_held"),
    ("dynamo:raw", "last-copy"): ("evict", "evict_held"),
}


@pytest.mark.parametrize(("target", "semantics"), sorted(SURVEY))
def test_without_evictions_of_chosen_blocks_each_mode_holds_its_claim(
    target: str, semantics: str
) -> None:
    """Evicting a block (a failed KV load) is behind findings F1 and F2; without it the
    duplicate filter makes Dynamo right under multiset, and the bare tree under last-copy."""
    factory = resolve("events", target).factory
    report = check_events(factory, semantics=[semantics], without=SURVEY[(target, semantics)])
    assert report.conforms, report.program
