"""The mutation triage (bench/mutation_triage.toml) names mutants that still exist.

``bench/mutation.py`` exits 1 on a survivor nobody triaged; this test keeps the
other direction honest: an entry whose mutant disappeared (the code changed)
must be removed or re-triaged, not left to excuse a different mutant later.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = {"equivalent", "gap", "hang"}


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvpool_bench_mutation", ROOT / "bench" / "mutation.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_triaged_mutant_exists_and_is_explained() -> None:
    driver = _driver()
    files = sorted(p for p in (ROOT / "impl").glob("*.py") if p.name != "__init__.py")
    keys = {
        m.key
        for f in files
        for m in driver.mutants(f, driver.module_of(f), None, with_source=False)
    }
    triage = driver.load_triage()
    assert triage, "bench/mutation_triage.toml is missing or empty"
    stale = sorted(set(triage) - keys)
    assert not stale, f"triaged mutants that no longer exist: {stale}"
    for key, entry in triage.items():
        assert entry["verdict"] in VERDICTS, key
        assert len(entry["why"].split()) >= 8, f"{key}: say why in a sentence"


def test_mutant_keys_are_unique_and_carry_no_line_number() -> None:
    driver = _driver()
    path = ROOT / "impl" / "pool.py"
    found = driver.mutants(path, driver.module_of(path), None, with_source=False)
    keys = [m.key for m in found]
    assert len(keys) == len(set(keys))
    assert all(f":{m.line}:" not in m.key for m in found)


def test_the_mutant_runner_imports_the_checks_it_runs() -> None:
    """The runner's imports are a string run in a child: a renamed check breaks it silently,
    every mutant then scoring "invalid" (which happened once, after specs/ was restructured)."""
    driver = _driver()
    for path in (ROOT / "impl" / "free_queue.py", ROOT / "impl" / "manager.py"):
        layer = driver.LAYERS.get(path.name, "pool")
        assert driver.imports_fail(path, layer) == "", path
