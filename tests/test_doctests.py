"""Every docstring example in the package runs, and the README's Python session too."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import kvpool.impl
import kvpool.model
import kvpool.specs

MODULES = sorted(
    info.name
    for package in (kvpool.model, kvpool.impl, kvpool.specs)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not info.name.endswith(".__main__")  # importing an entry point runs it
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_public_model_operations_all_carry_an_example() -> None:
    """sortedcontainers style: each public operation shows a doctest."""
    from kvpool.model import pool

    public = [getattr(pool, name) for name in dir(pool) if not name.startswith("_")]
    operations = [f for f in public if callable(f) and f.__module__ == pool.__name__]
    missing = [f.__name__ for f in operations if ">>>" not in (f.__doc__ or "")]
    assert operations and not missing


def test_readme_python_session_runs() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    parser = doctest.DocTestParser()
    test = parser.get_doctest(readme, {}, "README.md", "README.md", 0)
    assert test.examples, "the README lost its Python example"
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
