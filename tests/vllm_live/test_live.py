"""A live vLLM 0.32.0 engine (CPU build) serves seeded workloads; its recorded histories are
checked against the model: clean runs conform, planted bugs are found and minimised."""

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.specs.cli import app
from kvpool.specs.history import check_history, read_history

runner = CliRunner()

# A small cache that still evicts, refuses and preempts: bugs show within 8 requests.
SMALL = ("--requests", "8", "--blocks", "11", "--max-model-len", "288", "--max-tokens", "16")


def test_the_default_workload_conforms_with_evictions_refusals_and_preemptions(
    record: Callable[..., Path], tmp_path: Path
) -> None:
    path = record(tmp_path / "h.jsonl", "--requests", "40", "--blocks", "20", "--snapshots")
    history = read_history(path)
    assert history.header.engine["version"] == "0.32.0"
    verdict = check_history(history)
    assert verdict.conforms, verdict.divergence
    assert verdict.counts["evictions"] > 0
    assert verdict.counts["refusals"] > 0
    assert verdict.counts["preemptions"] >= 1
    assert verdict.checked["manager"] > 1000 and verdict.checked["pool"] > 1000
    result = runner.invoke(app, ["history", "check", str(path)])
    assert result.exit_code == 0, result.output


def test_a_sliding_window_hybrid_conforms(record: Callable[..., Path], tmp_path: Path) -> None:
    path = record(tmp_path / "h.jsonl", "--model", "hybrid", "--blocks", "30", "--snapshots")
    history = read_history(path)
    assert [g.attention for g in history.header.groups] == ["sliding_window", "full"]
    verdict = check_history(history)
    assert verdict.conforms, verdict.divergence
    assert verdict.counts["evictions"] > 0


@pytest.mark.parametrize(
    ("bug", "what"), [("stale_hash", "cache hit"), ("forward_free", "new blocks")]
)
def test_a_planted_bug_is_exit_1_and_minimised_to_at_most_5_requests(
    record: Callable[..., Path], tmp_path: Path, bug: str, what: str
) -> None:
    path = record(tmp_path / "h.jsonl", *SMALL, "--plant", f"tests.vllm_live.planted:{bug}")
    result = runner.invoke(app, ["history", "check", str(path)])
    assert result.exit_code == 1, result.output
    assert f"(manager layer): {what}" in result.output
    minimised = read_history(tmp_path / "h.minimised.jsonl")
    requests = {c["a"]["request"]["id"] for c in minimised.calls if "request" in c["a"]}
    assert 1 <= len(requests) <= 5
    again = runner.invoke(
        app, ["history", "check", "--no-minimise", str(tmp_path / "h.minimised.jsonl")]
    )
    assert again.exit_code == 1
    assert what in again.output
