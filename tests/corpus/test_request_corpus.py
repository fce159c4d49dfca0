"""The ``ci`` profile finds every request-layer bug of the corpus, and the impl itself is clean.

As in ``test_corpus.py``, each bug is hunted in a fresh interpreter, so the
derandomized ``ci`` programs do not depend on what other tests did to
Hypothesis' process-wide state.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvpool.specs.runner.settings  # noqa: F401  (registers the ci profile)
from kvpool.impl.manager import KVCacheManager
from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
from kvpool.specs.request.invariants import RequestInvariantViolation
from kvpool.specs.request.machine import ManagerMachine, manager_machine
from tests.corpus.bugs import BUGS
from tests.corpus.request_bugs import REQUEST_BUGS, RequestBug, spec_of, target_of

ROOT = Path(__file__).resolve().parents[2]


def hunt(bug: RequestBug) -> tuple[bool, int, str | None, str | None]:
    """Run ``ci`` on the bug in a fresh interpreter: (conforms, programs, kind, failure)."""
    script = (
        "import json\n"
        "from kvpool.specs.request.check import run_request_conformance\n"
        "from tests.corpus.request_bugs import REQUEST_BUGS, spec_of\n"
        f"bug = next(b for b in REQUEST_BUGS if b.name == {bug.name!r})\n"
        "r = run_request_conformance(spec_of(bug), hypothesis_profile='ci', target_name=bug.name)\n"
        "print(json.dumps([r.conforms, r.examples_run, r.failure_kind, r.failure]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    conforms, programs, kind, failure = json.loads(result.stdout.strip().splitlines()[-1])
    return conforms, programs, kind, failure


@pytest.mark.parametrize("bug", REQUEST_BUGS, ids=[b.name for b in REQUEST_BUGS])
def test_ci_profile_finds_the_bug(bug: RequestBug) -> None:
    conforms, programs, kind, failure = hunt(bug)
    assert not conforms, f"{bug.name} was not found in {programs} programs"
    assert kind in {"divergence", "invariant"}, failure


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
