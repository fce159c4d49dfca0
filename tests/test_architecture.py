"""The architecture holds: the import contract, no import circles, no adapter in the runner.

The contract is in pyproject.toml (``[tool.importlinter]``) and
docs/architecture.md draws it. import-linter and grimp read the installed
package, so the ``package-dir`` mapping (``kvpool.specs`` lives in ``specs/``)
does not matter. Imports inside functions count; imports under
``if TYPE_CHECKING:`` do not (they never run).
"""

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

import kvpool.model

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_import_contract_is_kept() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        ("model/state.py", "import kvpool.specs.runner.report", "specs, then impl, then model"),
        ("specs/runner/run.py", "import kvpool.specs.pool.check", "the floors of kvpool.specs"),
        ("specs/targets/cmd/pool.py", "import kvpool.specs.runner.run", "no adapter imports"),
        ("specs/pool/target.py", "import kvpool.specs.pool.machine", "the same files in every"),
    ],
    ids=["model-imports-specs", "runner-imports-a-layer", "adapter-imports-runner", "target-up"],
)
def test_the_contract_catches_a_planted_wrong_way_import(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    """A copy of the installed package with one import pointing the wrong way is refused."""
    installed = Path(next(iter(kvpool.model.__path__))).parent  # the kvpool/ directory
    copy = tmp_path / "site" / "kvpool"
    # Without bytecode caches: other test workers write them while the tree is copied.
    shutil.copytree(installed, copy, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    # A regular package first on the path hides the installed namespace package;
    # two portions of one namespace would let either copy of a module win.
    (copy / "__init__.py").touch()
    target = copy / module
    # A function-level import: the contract must see those too.
    target.write_text(target.read_text() + f"\n\ndef _planted() -> None:\n    {planted}\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = lint_imports(tmp_path, pythonpath=tmp_path / "site")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout, result.stdout


def import_cycles(graph: grimp.ImportGraph, modules: Iterable[str]) -> list[list[str]]:
    """The import circles among ``modules``: strongly connected components of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("kvpool", exclude_type_checking_imports=True, cache_dir=None)
    assert import_cycles(graph, graph.modules) == []


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c", "d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert import_cycles(graph, graph.modules) == [["a", "b", "c"]]


def test_no_adapter_replaces_anything_in_the_runner() -> None:
    """Adapters neither import the runner (the contract) nor assign into another module."""
    adapters = ROOT / "specs" / "targets"
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in adapters.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ("vars(" in line and "] =" in line) or "setattr(kvpool" in line
    ]
    assert offenders == []


PURE_ONLY = {"__init__", "vllm_shape"}
"""impl/ modules the compiled build leaves as Python: ``__init__`` reports which build
loaded, and ``vllm_shape`` only shapes a drop-in's events and map view, off the hot paths."""


def test_the_compiled_build_compiles_every_other_impl_module() -> None:
    """A module missing from setup.py's COMPILED list runs as Python inside the compiled
    build, silently slower (it happened to seven request-layer modules once)."""
    listing = (ROOT / "setup.py").read_text().split("COMPILED = [", 1)[1].split("]", 1)[0]
    listed = set(re.findall(r'"(\w+)"', listing))
    modules = {path.stem for path in (ROOT / "impl").glob("*.py")}
    assert listed == modules - PURE_ONLY
