"""The ``ci`` profile finds every request-layer bug of the corpus, and the impl itself is clean.

As in ``test_corpus.py``, each bug is hunted in a fresh interpreter, so the
derandomized ``ci`` programs do not depend on what other tests did to
Hypothesis' process-wide state.
"""

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvpool.specs.runner.settings  # noqa: F401  (registers the ci profile)
from kvpool.impl.manager import KVCacheManager
from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import ManagerMachine, manager_machine
from tests.corpus import assert_found_by_what_it_plants
from tests.corpus.bugs import BUGS
from tests.corpus.request_bugs import REQUEST_BUGS, RequestBug, cli_target, spec_of, target_of
from tests.kit.helpers import run_kvpool


def hunt(target: str, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """``kvpool check --layer request`` with ``ci`` on a target: (exit code, JSON report).

    Unshrunk: whether it is found is what matters here, and the first failing program is
    the one a shrinking run starts from (the shrunk program is tests/kit/test_reports.py's)."""
    report = tmp_path / "report.json"
    result = run_kvpool(
        "check",
        "--layer",
        "request",
        "--target",
        target,
        "--hypothesis-profile",
        "ci",
        "--no-shrink",
        "--format",
        "json",
        "--output",
        str(report),
        "--regression-dir",
        str(tmp_path / "regression"),
        timeout=600,
    )
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result.returncode, json.loads(report.read_text())


@pytest.mark.parametrize("bug", REQUEST_BUGS, ids=[b.name for b in REQUEST_BUGS])
def test_ci_profile_finds_the_bug_from_the_command_line(bug: RequestBug, tmp_path: Path) -> None:
    code, report = hunt(cli_target(bug), tmp_path)
    assert code == 1, f"{bug.name} was not found in {report.get('examples_run')} programs"
    assert report["failure_kind"] in {"divergence", "invariant"}, report["failure"]
    assert_found_by_what_it_plants(bug.name, report["failure"])
    assert list((tmp_path / "regression").glob("test_kvpool_regression_*.py"))


def test_the_clean_manager_conforms_from_the_command_line(tmp_path: Path) -> None:
    code, report = hunt("tests.corpus.request_bugs:clean", tmp_path)
    assert code == 0, report["failure"]


def test_corpus_is_big_enough_and_documented() -> None:
    assert len(REQUEST_BUGS) >= 6
    assert len(BUGS) + len(REQUEST_BUGS) >= 15
    names = [b.name for b in REQUEST_BUGS]
    assert len(set(names)) == len(names)
    assert not set(names) & {b.name for b in BUGS}
    for bug in REQUEST_BUGS:
        assert issubclass(bug.manager, KVCacheManager) and bug.manager is not KVCacheManager
        doc = bug.manager.__doc__
        assert doc and len(doc.split()) >= 20, bug.name
        if bug.upstream != "-":
            assert bug.upstream.split("#")[-1] in doc, bug.name
        else:
            assert "No upstream issue located" in doc, bug.name
        assert bug.layouts and bug.min_window >= 1
    assert sum(not b.unsafe for b in REQUEST_BUGS) >= 2


def test_unmodified_manager_through_the_same_factory_conforms() -> None:
    """The clean manager, built by ``target_of`` like every bug, on every bug's scope."""
    clean = RequestBug("clean", KVCacheManager, "-")
    report = run_manager_conformance(spec_of(clean, target_of(KVCacheManager)))
    assert report.conforms, report.failure


@pytest.mark.parametrize(
    "bug", [b for b in REQUEST_BUGS if b.unsafe], ids=[b.name for b in REQUEST_BUGS if b.unsafe]
)
def test_the_ground_truth_alone_finds_each_unsafe_bug(bug: RequestBug) -> None:
    """No model at all: a bug marked unsafe breaks a safety property of request_invariants."""
    machine: type[ManagerMachine] = manager_machine(
        target_of(bug.manager),
        layouts=bug.layouts,
        lockstep=False,
        min_window=bug.min_window,
        name=f"Unsafe_{bug.name.replace('-', '_')}",
    )
    chosen = settings(
        settings.get_profile("ci"),
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.generate],
    )
    with pytest.raises(RequestInvariantViolation):
        run_state_machine_as_test(machine, settings=chosen)
