"""Counterexamples: a planted bug yields the minimal program, the two states side by side,
and a regression test (plus a vector) that fails on the bug and passes on the impl."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.model import PoolConfig
from kvpool.specs.conformance import ConformanceReport
from kvpool.specs.pool.counterexample import explain
from kvpool.specs.pool.record import Recorder
from kvpool.specs.regression import Replay
from kvpool.specs.runner.render import save
from kvpool.specs.runner.render import to_json as _to_json
from kvpool.specs.target import Snapshottable
from tests.kit.buggy_pool import BuggyNoSnapshot, make_target
from tests.kit.helpers import ROOT, assert_no_traceback, run_kvpool

BUGGY = "tests.kit.buggy_pool:make_target"


@pytest.fixture(scope="module")
def planted(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    directory = tmp_path_factory.mktemp("planted")
    result = run_kvpool(
        "check", "--target", BUGGY, "--hypothesis-profile", "ci", "--steps", "8", cwd=directory
    )
    return result, directory / "kvpool-regression"


def test_the_report_shows_the_program_the_parting_step_and_the_states(
    planted: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, _ = planted
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "Minimal failing program" in out
    assert re.search(r'step \d+: free_blocks \{"block_ids": \[[\d, ]+\]\} -> null', out)
    assert re.search(r'Where they part: step (\d) of \1, free_blocks \{"block_ids": \[', out)
    assert "The two states side by side" in out
    side_by_side = [line for line in out.splitlines() if line.startswith("│") and "≠" in line]
    assert len(side_by_side) == 1
    assert side_by_side[0].count("free queue (next to evict first):") == 2
    assert "Regression test" in out and "def test_kvpool_regression_" in out
    assert_no_traceback(result)


def _pytest(test_file: Path, target: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPOOL_TARGET": target, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=test_file.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_regression_test_fails_on_the_bug_and_passes_on_the_impl(
    planted: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, directory = planted
    (test_file,) = directory.glob("test_kvpool_regression_*.py")
    on_bug = _pytest(test_file, BUGGY)
    assert on_bug.returncode == 1, on_bug.stdout
    assert "1 failed" in on_bug.stdout
    assert "the target's state differs from the model's" in on_bug.stdout
    on_impl = _pytest(test_file, "impl")
    assert on_impl.returncode == 0, on_impl.stdout
    assert "1 passed" in on_impl.stdout


def test_the_vector_file_reproduces_it_too(
    planted: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, directory = planted
    (vector_file,) = directory.glob("kvpool_regression_*.jsonl")
    vector = json.loads(vector_file.read_text())
    assert vector["id"].startswith("regression/") and vector["tags"] == ["regression"]
    on_bug = run_kvpool("vectors", "run", str(vector_file), "--target", BUGGY)
    assert on_bug.returncode == 1, on_bug.stdout
    on_impl = run_kvpool("vectors", "run", str(vector_file), "--target", "impl")
    assert on_impl.returncode == 0, on_impl.stdout


def _recorded_divergence() -> Recorder:
    """The append bug without snapshot, driven by hand: block 3 comes out instead of 1."""
    recorder = Recorder(BuggyNoSnapshot)
    target = recorder(PoolConfig(4))
    assert not isinstance(target, Snapshottable)
    assert list(target.get_new_blocks(2)) == [1, 2]
    target.free_blocks([1])
    target.get_num_free_blocks()
    assert list(target.get_new_blocks(1)) == [3]  # the model hands out block 1
    return recorder


def test_the_json_report_carries_the_counterexample(tmp_path: Path) -> None:
    counterexample = explain(_recorded_divergence(), "buggy")
    assert counterexample is not None
    save(counterexample, tmp_path)
    report = ConformanceReport("buggy", 1, ("hashless-first",), "ci", conforms=False)
    report.failure_kind, report.counterexample = "divergence", counterexample
    data = json.loads(_to_json(report))
    assert data["counterexample"]["step"] == 3
    assert data["counterexample"]["compared"] == "result"
    assert data["counterexample"]["test_file"].startswith(str(tmp_path))
    assert Path(data["counterexample"]["vector_file"]).read_text().startswith('{"id":"regression/')


def test_without_snapshot_the_results_part_and_no_state_is_asserted() -> None:
    counterexample = explain(_recorded_divergence(), "buggy")
    assert counterexample is not None
    assert (counterexample.step, counterexample.steps) == (3, 3)
    assert counterexample.compared == "result"
    assert counterexample.problem == "the model returns [1], the target returned [3]"
    assert "expect_state" not in counterexample.regression_test
    namespace: dict[str, object] = {}
    exec(compile(counterexample.regression_test, "regression.py", "exec"), namespace)
    test = next(v for k, v in namespace.items() if k.startswith("test_kvpool_regression_"))
    namespace["TARGET"] = "impl"
    test()  # type: ignore[operator]
    namespace["TARGET"] = BuggyNoSnapshot
    with pytest.raises(AssertionError, match="step 3, get_new_blocks"):
        test()  # type: ignore[operator]


def test_replay_names_the_step_that_fails() -> None:
    pool = Replay(make_target, {"num_blocks": 4, "enable_caching": True,
                                "hash_block_size": 1, "enable_events": False,
                                "profile": "hashless-first"})  # fmt: skip
    pool.step("get_new_blocks", {"num_blocks": 2}, ok=[1, 2])
    pool.step("free_blocks", {"block_ids": [1]}, ok=None)
    with pytest.raises(AssertionError, match=r"step 3, get_new_blocks .*model returns \[1\]"):
        pool.step("get_new_blocks", {"num_blocks": 1}, ok=[1])
