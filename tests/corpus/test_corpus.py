"""The ``ci`` profile finds every bug of the corpus, and the impl itself is clean.

Each bug is hunted in a fresh interpreter: the derandomized ``ci`` programs
must not depend on what other tests did to Hypothesis' process-wide state
(in one full-suite run a bug went unfound in-process that a fresh process
finds at once).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.impl import BlockPool
from kvpool.specs.conformance import run_conformance
from tests.corpus import assert_found_by_what_it_plants
from tests.corpus.bugs import BUGS, Bug, target_of


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_ci_profile_finds_the_bug(bug: Bug) -> None:
    script = (
        "import json\n"
        "from kvpool.specs.conformance import run_conformance\n"
        "from tests.corpus.bugs import BUGS, target_of\n"
        f"bug = next(b for b in BUGS if b.name == {bug.name!r})\n"
        # Found is what matters here; the shrunk program is tests/kit/test_reports.py's.
        "r = run_conformance(target_of(bug.pool), level=bug.level, hypothesis_profile='ci',"
        " target_name=bug.name, shrink=False)\n"
        "print(json.dumps([r.conforms, r.examples_run, r.failure_kind, r.failure]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    conforms, programs, kind, failure = json.loads(result.stdout.strip().splitlines()[-1])
    assert not conforms, f"{bug.name} was not found in {programs} programs"
    assert kind in {"divergence", "invariant"}, failure
    assert_found_by_what_it_plants(bug.name, failure)


def test_corpus_is_big_enough_and_documented() -> None:
    assert len(BUGS) >= 15
    assert len({b.name for b in BUGS}) == len(BUGS)
    for bug in BUGS:
        assert issubclass(bug.pool, BlockPool) and bug.pool is not BlockPool
        assert bug.pool.__doc__ and len(bug.pool.__doc__.split()) >= 20, bug.name
        assert bug.level in (1, 2)
        if bug.upstream != "-":
            assert bug.upstream.split("#")[-1] in bug.pool.__doc__, bug.name
        else:
            assert "No upstream issue located" in bug.pool.__doc__, bug.name


def test_unmodified_pool_through_the_same_factory_conforms() -> None:
    report = run_conformance(target_of(BlockPool), level=2, hypothesis_profile="ci")
    assert report.conforms, report.failure


def test_mutation_profile_neither_shrinks_nor_saves() -> None:
    from hypothesis import Phase, settings

    chosen = settings.get_profile("mutation")
    assert chosen.database is None
    assert Phase.shrink not in chosen.phases and Phase.generate in chosen.phases
    assert chosen.derandomize
