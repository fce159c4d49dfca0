"""The ``ci`` profile finds every bug of the SGLang corpus, in every core it is planted into.

The bugs are hunted in one fresh interpreter (SGLang's import takes most of
a quarter of a minute): the derandomized ``ci`` programs must not depend on
what other tests did to Hypothesis' process-wide state. The hunt stops at
the first failing program (no shrinking); ``bench/sglang_corpus.py``
measures shrunk programs and times.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus import assert_found_by_what_it_plants

pytestmark = pytest.mark.usefixtures("require_native_hash")

ROOT = Path(__file__).resolve().parents[2]

HUNT = """
import json
from kvpool.specs.radix.check import check_radix
from tests.sglang.bugs import BUGS
for bug in BUGS:
    for core in bug.plants:
        r = check_radix(bug.factory(core), bug.policy, 1, events=bug.events,
                        page_sizes=bug.page_sizes, hypothesis_profile="ci", shrink=False)
        print(json.dumps([bug.name, core, r.conforms, r.failure_kind, r.examples_run, r.failure]))
"""


def test_ci_profile_finds_every_bug_in_every_core() -> None:
    result = subprocess.run(
        [sys.executable, "-c", HUNT], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(rows) >= 20
    missed = [(name, core, n) for name, core, conforms, _, n, _ in rows if conforms]
    assert not missed, f"not found: {missed}"
    assert {kind for *_, kind, _, _ in rows} == {"divergence"}
    assert {core for _, core, *_ in rows} == {"legacy", "python", "rust"}
    for name, core, _, _, _, failure in rows:
        assert_found_by_what_it_plants(f"{name} ({core})", failure)


def test_the_corpus_is_documented() -> None:
    from tests.sglang.bugs import BUGS, UPSTREAM_URLS

    assert len(BUGS) >= 10 and len({b.name for b in BUGS}) == len(BUGS)
    for bug in BUGS:
        assert len(bug.story.split()) >= 20, bug.name
        if bug.upstream == "-":
            assert "No upstream issue located" in bug.story, bug.name
        else:
            assert UPSTREAM_URLS[bug.upstream] in bug.story, bug.name


@pytest.mark.parametrize("core", ["legacy", "python", "rust"])
def test_the_unmodified_caches_through_the_same_factory_conform(core: str) -> None:
    from kvpool.specs.radix.check import check_radix
    from kvpool.specs.targets.sglang.radix import SglangRadixFactory

    report = check_radix(SglangRadixFactory(core), "lfu", 1, hypothesis_profile="ci")
    assert report.conforms, report.failure
