"""Mutation testing of kvpool.impl against the conformance machine.

    python bench/mutation.py impl/free_queue.py
    python bench/mutation.py impl/pool.py --functions free_blocks touch --jobs 2

Each mutant is one small change to one function of the file (a comparison
flipped, ``+`` for ``-``, a constant off by one, ``and`` for ``or``, ``is``
for ``is not``, a statement deleted). It is imported *in a subprocess* in
place of the real module (a meta-path finder serves the mutated source), so
the working tree is never touched and concurrent test runs are unaffected.
The subprocess runs the check kvpool relies on: ``run_conformance`` on the
impl at level 2 with every semantics profile, under the ``mutation`` settings
profile (``ci`` without shrinking and without a database).

Verdicts: ``killed`` (the check reported a divergence or an invariant),
``survived`` (the check passed; with ``--unit-tests`` the survivors are
also run against those pytest paths: ``unit-killed`` if they fail), ``timeout`` (no verdict within
``--timeout`` seconds: *not* counted as killed), ``invalid`` (the mutant
does not import). A mutant that makes the check crash (an exception other
than a divergence escapes ``run_conformance``) counts as killed. The score
is killed / (killed + survived + timeout).

Why not mutmut: mutmut 3 rewrites the source tree into ``mutants/`` and
imports it by path, but kvpool's packages are mapped (``kvpool.impl`` is
``impl/``) and installed editable, so the tests would import the unmutated
code; it also runs the test suite, where this driver runs the one check
whose power is being measured. mutmut stays in the ``mutation`` extra for
anyone who wants its operators on a standard layout.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"impl": "kvpool.impl", "model": "kvpool.model", "specs": "kvpool.specs"}

RUNNER = r"""
import importlib.abc, importlib.util, sys
name, path = sys.argv[1], sys.argv[2]

class Mutated(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, search_path, target=None):
        if fullname == name:
            return importlib.util.spec_from_file_location(fullname, path)
        return None

sys.meta_path.insert(0, Mutated())
try:
    from kvpool.model import PROFILES
    from kvpool.specs.adapters.impl_target import ImplTarget
    from kvpool.specs.conformance import run_conformance
except Exception as error:
    print("invalid", repr(error)); sys.exit(3)
assert sys.modules[name].__file__ == path, "the mutant was not imported"
report = run_conformance(ImplTarget, level=2, profile=sorted(PROFILES),
                         hypothesis_profile="mutation")
print("survived" if report.conforms else "killed", report.failure_kind or "")
sys.exit(0 if report.conforms else 1)
"""

PYTEST_RUNNER = (
    RUNNER.split("try:")[0]
    + r"""
import pytest
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *sys.argv[3:]]))
"""
)

SWAP_CMP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
SWAP_BIN: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
}


@dataclass
class Mutant:
    index: int
    function: str
    line: int
    description: str
    source: str


def _mutations(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(description, replacement) for one node."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        swapped = SWAP_CMP.get(type(node.ops[0]))
        if swapped is not None:
            new = copy.deepcopy(node)
            new.ops = [swapped()]
            yield f"{type(node.ops[0]).__name__} -> {swapped.__name__}", new
    elif isinstance(node, ast.BinOp | ast.AugAssign):
        swapped_op = SWAP_BIN.get(type(node.op))
        if swapped_op is not None:
            new = copy.deepcopy(node)
            new.op = swapped_op()
            yield f"{type(node.op).__name__} -> {swapped_op.__name__}", new
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"{type(node.op).__name__} -> {type(new.op).__name__}", new
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        yield f"{node.value} -> {node.value + 1}", ast.Constant(node.value + 1)
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield f"{node.value} -> {not node.value}", ast.Constant(not node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "not x -> x", copy.deepcopy(node.operand)


def _statement_deletions(body: list[ast.stmt]) -> Iterator[tuple[int, str]]:
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.Assign | ast.AugAssign | ast.Expr) and not (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            yield i, f"delete `{ast.unparse(stmt)[:50]}`"


def mutants(path: Path, functions: set[str] | None) -> list[Mutant]:
    tree = ast.parse(path.read_text())
    found: list[Mutant] = []
    targets: list[tuple[str, ast.FunctionDef]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    targets.append((f"{node.name}.{item.name}", item))
        elif isinstance(node, ast.FunctionDef) and node in tree.body:
            targets.append((node.name, node))
    for qualname, function in targets:
        if functions and qualname.split(".")[-1] not in functions:
            continue
        # Expression-level mutations: rebuild the tree with one node replaced.
        for node in ast.walk(function):
            if node is function or isinstance(node, ast.arguments | ast.arg):
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                continue
            for description, replacement in _mutations(node):
                mutated = _replace(tree, node, replacement)
                found.append(
                    Mutant(
                        len(found),
                        qualname,
                        getattr(node, "lineno", function.lineno),
                        description,
                        mutated,
                    )
                )
        # Statement deletions, in every block of the function.
        for node in ast.walk(function):
            for field in ("body", "orelse"):
                body = getattr(node, field, None)
                if not isinstance(body, list) or not body or not isinstance(body[0], ast.stmt):
                    continue
                for i, description in _statement_deletions(body):
                    mutated = _delete(tree, body[i])
                    found.append(Mutant(len(found), qualname, body[i].lineno, description, mutated))
    return found


class _Replacer(ast.NodeTransformer):
    def __init__(self, old: ast.AST, new: ast.AST | None) -> None:
        self.old, self.new = old, new

    def generic_visit(self, node: ast.AST) -> ast.AST | None:
        if node is self.old:
            if self.new is None:
                return ast.Pass()
            return ast.copy_location(self.new, node)
        return super().generic_visit(node)


def _replace(tree: ast.Module, old: ast.AST, new: ast.AST) -> str:
    # Work on the original tree and undo: deepcopy would lose node identity.
    result = _Replacer(old, new).visit(copy.copy(tree))
    source = ast.unparse(ast.fix_missing_locations(result))
    _Replacer(new, old).visit(tree)
    return source


def _delete(tree: ast.Module, stmt: ast.stmt) -> str:
    replacement = ast.Pass()
    result = _Replacer(stmt, replacement).visit(copy.copy(tree))
    source = ast.unparse(ast.fix_missing_locations(result))
    _Replacer(replacement, stmt).visit(tree)
    return source


def run(
    mutant: Mutant, module: str, workdir: Path, timeout: float, unit_tests: list[str]
) -> tuple[str, float]:
    path = workdir / f"mutant_{mutant.index}.py"
    path.write_text(mutant.source)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, module, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    # No verdict printed: the mutant crashed the check (an exception other
    # than a divergence escaped), which is a failed check, i.e. a kill.
    crashed = "killed" if "Traceback" in done.stderr else "invalid"
    verdict = (done.stdout.split() or [crashed])[0]
    if verdict == "survived" and unit_tests:
        # A survivor of the machine: do kvpool's unit tests of the module kill it?
        try:
            tests = subprocess.run(
                [sys.executable, "-c", PYTEST_RUNNER, module, str(path), *unit_tests],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            verdict = "survived" if tests.returncode == 0 else "unit-killed"
        except subprocess.TimeoutExpired:
            verdict = "survived"
    return verdict, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, help="e.g. impl/free_queue.py")
    parser.add_argument("--functions", nargs="*", help="only these function names")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--limit", type=int, help="only the first N mutants")
    parser.add_argument("--json", type=Path, help="write every verdict here")
    parser.add_argument(
        "--unit-tests",
        nargs="*",
        default=[],
        help="pytest paths run on the machine's survivors (verdict unit-killed)",
    )
    args = parser.parse_args()
    relative = args.file.resolve().relative_to(ROOT)
    module = ".".join([PACKAGES[relative.parts[0]], *relative.with_suffix("").parts[1:]])
    found = mutants(args.file, set(args.functions) if args.functions else None)
    if args.limit:
        found = found[: args.limit]
    print(f"{len(found)} mutants of {module}", file=sys.stderr, flush=True)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        verdicts = pool.map(
            lambda m: run(m, module, Path(tmp), args.timeout, args.unit_tests), found
        )
        for mutant, (verdict, seconds) in zip(found, verdicts, strict=True):
            print(
                f"{verdict:9} {seconds:6.1f}s  {mutant.function}:{mutant.line}  "
                f"{mutant.description}",
                flush=True,
            )
            results.append(
                {
                    "function": mutant.function,
                    "line": mutant.line,
                    "mutation": mutant.description,
                    "verdict": verdict,
                    "seconds": round(seconds, 2),
                }
            )
    counts = {
        v: sum(r["verdict"] == v for r in results)
        for v in ("killed", "unit-killed", "survived", "timeout", "invalid")
    }
    scored = sum(counts[v] for v in ("killed", "unit-killed", "survived", "timeout"))
    score = counts["killed"] / scored if scored else 0.0
    with_units = (counts["killed"] + counts["unit-killed"]) / scored if scored else 0.0
    print(
        f"{counts}; mutation score of the machine {score:.1%}, "
        f"with the unit tests {with_units:.1%}, of {scored}"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"module": module, "counts": counts, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
