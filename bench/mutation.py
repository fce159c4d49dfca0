"""Mutation testing of kvpool.impl against the conformance machines.

    python bench/mutation.py impl/                      # every module of impl/
    python bench/mutation.py impl/pool.py --functions free_blocks touch --jobs 2
    python bench/mutation.py impl/ --jobs 2 --json mutation.json

Each mutant is one small change to one function of a module (a comparison
flipped, ``+`` for ``-``, a constant off by one, ``and`` for ``or``, ``is``
for ``is not``, a statement deleted). Expressions inside f-strings are left
alone: they build error messages, and conformance compares exception types,
never message text. It is imported *in a subprocess* in
place of the real module (a meta-path finder serves the mutated source), so
the working tree is never touched and concurrent test runs are unaffected.

The subprocess first runs the check whose power is measured, chosen by the
module's layer: for the pool (``pool.py``, ``free_queue.py``, ``block.py``,
``invariants.py``) ``run_conformance`` on the impl at level 2 with every
semantics profile; for the request layer (``manager.py``,
``single_type.py``) ``run_manager_conformance`` on the impl's manager at
levels 1 and 2. Both
run under the ``mutation`` settings profile: ``ci`` without shrinking and
without the example database, so a kill is reported as soon as it is found
and no run replays another's failures. A mutant the machine lets through is
then run against the layer's unit tests (``pytest -x``, same profile).

Verdicts: ``killed`` (the machine reported a divergence or an invariant, or
crashed), ``unit-killed`` (the machine passed, a unit test failed),
``survived`` (both passed), ``timeout`` (no verdict within ``--timeout``
seconds: *not* a kill, it is scored as a survivor; a mutant that makes one
program loop is caught sooner by the checks' own 10-second program limit,
a real failure: kvpool reports a hanging target as a target error), ``invalid`` (the mutant
does not import; not scored). The score is
(killed + unit-killed) / (killed + unit-killed + survived + timeout).

Every survivor and timeout must be triaged in ``bench/mutation_triage.toml``
as ``equivalent`` (with the reason) or ``gap`` (with the plan); the run
lists untriaged ones and exits 1 if there are any, so a change to the impl
that adds an unkilled mutant cannot go unnoticed.

Why not mutmut or cosmic-ray: mutmut 3 copies the tree into ``mutants/``
and imports it by path, but ``kvpool.impl`` is mapped from ``impl/`` and
installed editable, so the tests import the unmutated code. cosmic-ray
mutates the file in place, which works through the editable install's
symlinks, but it then owns the working tree (no other run, no editing,
while it works) and runs one mutant at a time per working copy. This driver
serves the mutant to one subprocess only, runs ``--jobs`` of them side by
side in one tree, and keeps timeouts apart from kills.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"impl": "kvpool.impl", "model": "kvpool.model", "specs": "kvpool.specs"}

RUNNER = r"""
import importlib, importlib.abc, importlib.util, sys
name, path, layer = sys.argv[1], sys.argv[2], sys.argv[3]

class Mutated(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, search_path, target=None):
        if fullname == name:
            return importlib.util.spec_from_file_location(fullname, path)
        return None

sys.meta_path.insert(0, Mutated())
try:
    importlib.import_module(name)
    from kvpool.model import PROFILES
    from kvpool.specs.targets.impl.pool import ImplTarget
    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.request.check import run_request_conformance
    from kvpool.specs.request.target import ManagerTargetSpec
    from kvpool.specs.targets.registry import resolve
except Exception as error:
    print("invalid", repr(error)); sys.exit(3)
if sys.modules[name].__file__ != path:
    print("invalid", "the mutant was not the module imported"); sys.exit(3)
try:
    if layer == "manager":
        # Level 1 and level 2 draw different fixed samples: run both, as CI does.
        impl = resolve("request", "impl")
        for level in (1, 2):
            report = run_request_conformance(ManagerTargetSpec(impl.factory, **impl.scope),
                                             level=level, hypothesis_profile="mutation",
                                             program_timeout=10)
            if not report.conforms:
                break
    else:
        report = run_conformance(ImplTarget, level=2, profile=sorted(PROFILES),
                                 hypothesis_profile="mutation", program_timeout=10)
except BaseException as error:
    # The mutant broke the check itself (e.g. a NameError inside the impl):
    # the check failed, which is a kill.
    print("killed", "crash", repr(error)[:200]); sys.exit(1)
print("survived" if report.conforms else "killed", report.failure_kind or "")
sys.exit(0 if report.conforms else 1)
"""

PYTEST_RUNNER = (
    RUNNER.split("try:")[0]
    + r"""
import pytest
importlib.import_module(name)
assert sys.modules[name].__file__ == path, "the mutant was not the module imported"
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *sys.argv[4:]]))
"""
)

# The check whose power is measured, and the unit tests a survivor meets next.
LAYERS = {"manager.py": "manager", "single_type.py": "manager"}
UNIT_TESTS = {
    "pool": ["tests/impl", "tests/kit/test_vectors.py"],
    "manager": [
        "tests/request/test_impl_manager.py",
        "tests/request/test_single_type_lockstep.py",
        "tests/request/test_manager.py",
        "tests/request/test_managers.py",
        "tests/request/test_request_invariants.py",
        # the features the default machine scope never draws (EAGLE flags, connector loads,
        # hits inside a Mamba block, "align" reserves): without these their mutants "survive"
        "tests/request/test_eagle.py",
        "tests/request/test_external.py",
        "tests/request/test_mamba_fine.py",
        "tests/request/test_mamba_reserve.py",
        # take_events' stamps (0.3 s) and the scheduler's further calls with their own
        # machine (whole-sequence admission, admission caps; 9 s): without these the
        # mutants they kill "survive"
        "tests/request/test_impl_manager_events.py",
        "tests/request/test_scheduler_calls.py",
        # decode context parallelism's sharded blocks (12 s)
        "tests/request/test_geometry.py",
        # fine-grained hits' truncation and copies (the mutation round of 2026-11-29 found
        # its truncate_computed_blocks survivors killed by this file, which was not listed)
        "tests/request/test_copy_on_write.py",
    ],
}
TRIAGE = ROOT / "bench" / "mutation_triage.toml"

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
    module: str
    function: str
    line: int
    description: str
    source: str
    original: str = ""
    occurrence: int = 0

    @property
    def key(self) -> str:
        """Stable across edits elsewhere in the file: no line number."""
        where = f"{self.module}:{self.function}: {self.description} @ {self.original}"
        return where if not self.occurrence else f"{where} #{self.occurrence + 1}"


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
            arithmetic = copy.deepcopy(node)
            arithmetic.op = swapped_op()
            yield f"{type(node.op).__name__} -> {swapped_op.__name__}", arithmetic
    elif isinstance(node, ast.BoolOp):
        logic = copy.deepcopy(node)
        logic.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield f"{type(node.op).__name__} -> {type(logic.op).__name__}", logic
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


def mutants(
    path: Path, module: str, functions: set[str] | None, with_source: bool = True
) -> list[Mutant]:
    """Every mutant of the functions of ``path`` (all if ``functions`` is None).

    ``with_source=False`` skips writing each mutant's source: only keys are needed.
    """
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
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
        # Nothing inside an f-string: those are error messages, and results are
        # compared on exception types, never on message text.
        in_messages = {
            id(inner)
            for node in ast.walk(function)
            if isinstance(node, ast.JoinedStr)
            for inner in ast.walk(node)
        }
        for node in ast.walk(function):
            if node is function or isinstance(node, ast.arguments | ast.arg):
                continue
            if id(node) in in_messages:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                continue
            for description, replacement in _mutations(node):
                mutated = _replace(tree, node, replacement) if with_source else ""
                line = getattr(node, "lineno", function.lineno)
                found.append(Mutant(len(found), module, qualname, line, description, mutated))
        # Statement deletions, in every block of the function.
        for node in ast.walk(function):
            for field in ("body", "orelse"):
                body = getattr(node, field, None)
                if not isinstance(body, list) or not body or not isinstance(body[0], ast.stmt):
                    continue
                for i, description in _statement_deletions(body):
                    mutated = _delete(tree, body[i]) if with_source else ""
                    found.append(
                        Mutant(len(found), module, qualname, body[i].lineno, description, mutated)
                    )
    seen: dict[str, int] = {}
    for mutant in found:
        mutant.original = lines[mutant.line - 1].strip()
        base = mutant.key  # occurrence 0: no suffix yet
        mutant.occurrence = seen.get(base, 0)
        seen[base] = mutant.occurrence + 1
    return found


class _Replacer(ast.NodeTransformer):
    def __init__(self, old: ast.AST, new: ast.AST | None) -> None:
        self.old, self.new = old, new

    def generic_visit(self, node: ast.AST) -> ast.AST:
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


def run(mutant: Mutant, layer: str, workdir: Path, timeout: float) -> tuple[str, float]:
    path = workdir / f"{mutant.module}.{mutant.index}.py"
    path.write_text(mutant.source)
    # The unit tests load their settings profile from this variable.
    env = {**os.environ, "KVPOOL_HYPOTHESIS": "mutation"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUNNER, mutant.module, str(path), layer],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    # The runner prints a verdict for every outcome it can tell apart; a
    # process that died without one is not scored.
    verdict = (done.stdout.split() or ["invalid"])[0]
    if verdict == "survived":
        # A survivor of the machine: do kvpool's unit tests of the layer kill it?
        try:
            tests = subprocess.run(
                [sys.executable, "-c", PYTEST_RUNNER, mutant.module, str(path), layer]
                + UNIT_TESTS[layer],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
                env=env,
            )
            verdict = "survived" if tests.returncode == 0 else "unit-killed"
        except subprocess.TimeoutExpired:
            verdict = "timeout"
    return verdict, time.perf_counter() - started


def module_of(path: Path) -> str:
    relative = path.resolve().relative_to(ROOT)
    return ".".join([PACKAGES[relative.parts[0]], *relative.with_suffix("").parts[1:]])


def load_triage() -> dict[str, dict[str, str]]:
    """``key -> {"verdict": "equivalent" | "gap", "why": ...}`` from the committed file."""
    if not TRIAGE.exists():
        return {}
    entries = tomllib.loads(TRIAGE.read_text()).get("mutant", [])
    return {entry["key"]: entry for entry in entries}


def imports_fail(path: Path, layer: str) -> str:
    """What goes wrong when the runner imports its checks around the unmutated ``path``."""
    imports = RUNNER.split("try:\n    if layer")[0]
    done = subprocess.run(
        [sys.executable, "-c", imports, module_of(path), str(path.resolve()), layer],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()[-500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files or directories, e.g. impl/")
    parser.add_argument("--functions", nargs="*", help="only these function names")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--limit", type=int, help="only the first N mutants")
    parser.add_argument("--json", type=Path, help="write every verdict here")
    args = parser.parse_args()
    files = sorted(
        f
        for p in args.paths
        for f in (p.glob("*.py") if p.is_dir() else [p])
        if f.name != "__init__.py"
    )
    chosen = set(args.functions) if args.functions else None
    found = [m for f in files for m in mutants(f, module_of(f), chosen)]
    if args.limit:
        found = found[: args.limit]
    layer_of = {module_of(f): LAYERS.get(f.name, "pool") for f in files}
    for f in files:
        # Every mutant of a module whose checks cannot be imported would score "invalid"
        # and the run would pass having tested nothing: stop instead.
        broken = imports_fail(f, layer_of[module_of(f)])
        if broken:
            sys.exit(f"cannot mutation-test {f}: the unmutated module fails: {broken}")
    print(f"{len(found)} mutants of {len(files)} modules", file=sys.stderr, flush=True)
    triage = load_triage()
    results: list[dict[str, object]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        verdicts = pool.map(lambda m: run(m, layer_of[m.module], Path(tmp), args.timeout), found)
        for mutant, (verdict, seconds) in zip(found, verdicts, strict=True):
            triaged = triage.get(mutant.key, {}).get("verdict", "")
            unkilled = verdict in ("survived", "timeout")
            note = f"  [{triaged or 'UNTRIAGED'}]" if unkilled else ""
            print(
                f"{verdict:11} {seconds:6.1f}s  {mutant.module}:{mutant.line}  "
                f"{mutant.function}  {mutant.description}{note}",
                flush=True,
            )
            results.append(
                {
                    "key": mutant.key,
                    "module": mutant.module,
                    "function": mutant.function,
                    "line": mutant.line,
                    "mutation": mutant.description,
                    "verdict": verdict,
                    "triage": triaged,
                    "seconds": round(seconds, 2),
                }
            )
    wall = time.perf_counter() - started
    summarise(results, wall, args.jobs)
    if args.json:
        record = {"wall_seconds": round(wall), "jobs": args.jobs, "results": results}
        args.json.write_text(json.dumps(record, indent=1))
    untriaged = [r for r in results if r["verdict"] in ("survived", "timeout") and not r["triage"]]
    for r in untriaged:
        print(f"untriaged: {r['key']}")
    sys.exit(1 if untriaged else 0)


VERDICTS = ("killed", "unit-killed", "survived", "timeout", "invalid")


def summarise(results: list[dict[str, object]], wall: float, jobs: int) -> None:
    """One row per module, then the whole run, as a Markdown table."""
    print(
        "\n| module | mutants | killed by the machine | killed by unit tests | survived "
        "| timeout | invalid | equivalent | gap | score | score without equivalents |"
    )
    print("| --- " * 11 + "|")
    modules = sorted({str(r["module"]) for r in results})
    for name in [*modules, "all"]:
        rows = [r for r in results if name in ("all", r["module"])]
        counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
        unkilled = [r for r in rows if r["verdict"] in ("survived", "timeout")]
        equivalent = sum(r["triage"] == "equivalent" for r in unkilled)
        gaps = sum(r["triage"] == "gap" for r in unkilled)
        killed = counts["killed"] + counts["unit-killed"]
        scored = killed + counts["survived"] + counts["timeout"]
        score = f"{killed / scored:.1%}" if scored else "-"
        honest = scored - equivalent
        without = f"{killed / honest:.1%}" if honest else "-"
        label = "**all**" if name == "all" else f"`{name.removeprefix('kvpool.impl.')}`"
        cells = [label, len(rows), *counts.values(), equivalent, gaps, score, without]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nwall time {wall / 60:.1f} min with {jobs} jobs")


if __name__ == "__main__":
    main()
