"""kvpool against the real vLLM block pool: conformance, planted bugs, level-2 findings."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.specs.cli import app
from kvpool.specs.conformance import run_conformance
from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS, classify_divergence
from kvpool.specs.targets.vllm.pool import VllmTargetFactory
from tests.vllm.helpers import require_cached_release

pytestmark = pytest.mark.usefixtures("require_vllm")


def test_installed_vllm_conforms_at_level_1() -> None:
    report = run_conformance(VllmTargetFactory(), level=1, hypothesis_profile="ci")
    assert report.conforms, f"{report.failure}\n{report.program}"
    assert report.examples_run >= 150


@pytest.mark.parametrize(
    ("pool_class", "where"),
    [
        ("HashlessToBackPool", "free queue"),
        ("StaleHashPool", ""),
    ],
)
def test_a_planted_bug_is_reported_with_its_program(
    pool_class: str, where: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        app,
        [
            "check",
            "--target",
            f"vllm:tests.vllm.buggy_pools:{pool_class}",
            "--hypothesis-profile",
            "ci",
            "--examples",
            "100",
            "--regression-dir",
            str(tmp_path),
        ],
    )
    output = result.output
    assert result.exit_code == 1, output
    assert "Minimal failing program" in output
    # The program as the protocol operations vLLM's pool received, numbered as steps.
    program = output.split("Minimal failing program")[1].split("Where they part")[0]
    assert program.splitlines()[1].startswith("new_pool {")
    assert "step 1: " in program
    assert where in output


def test_a_level_2_divergence_is_a_known_finding() -> None:
    report = run_conformance(VllmTargetFactory(), level=2, hypothesis_profile="ci")
    assert not report.conforms
    assert report.failure_kind == "divergence"
    divergence = classify_divergence(report.failure)
    assert divergence is not None, report.failure
    assert divergence.finding is not None, report.failure
    assert divergence.finding in KNOWN_FINDINGS.values()


def test_a_suppressed_finding_is_stepped_over() -> None:
    first = run_conformance(VllmTargetFactory(), level=2, hypothesis_profile="ci")
    known = classify_divergence(first.failure)
    assert known is not None and known.finding is not None
    second = run_conformance(
        VllmTargetFactory(suppress=[known.finding.key]),
        level=2,
        hypothesis_profile="ci",
        max_examples=60,
    )
    again = classify_divergence(second.failure)
    assert again is None or again.finding is None or again.finding.key != known.finding.key


def test_a_cached_release_runs_in_a_child_interpreter(tmp_path: Path) -> None:
    require_cached_release("0.24.0")
    result = CliRunner().invoke(
        app,
        [
            "check",
            "--target",
            "vllm==0.24.0",
            "--hypothesis-profile",
            "ci",
            "--examples",
            "30",
            "--format",
            "json",
            "--output",
            str(tmp_path / "report.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = (tmp_path / "report.json").read_text()
    assert '"hashless-first"' in report
    assert '"vllm==0.24.0"' in report
