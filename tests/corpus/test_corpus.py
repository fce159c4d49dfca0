"""The ``ci`` profile finds every bug of the corpus, and the impl itself is clean."""

import pytest

from kvpool.impl import BlockPool
from kvpool.specs.conformance import run_conformance
from tests.corpus.bugs import BUGS, Bug, target_of


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_ci_profile_finds_the_bug(bug: Bug) -> None:
    report = run_conformance(
        target_of(bug.pool), level=bug.level, hypothesis_profile="ci", target_name=bug.name
    )
    assert not report.conforms, f"{bug.name} was not found in {report.examples_run} programs"
    assert report.failure_kind in {"divergence", "invariant"}, report.failure


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
