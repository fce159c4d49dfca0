"""How fast the conformance checks find each bug of the corpus.

The corpus has two layers: block-pool bugs (tests/corpus/bugs.py, checked by
``run_conformance``) and request-layer bugs in the KV cache manager
(tests/corpus/request_bugs.py, checked by ``run_request_conformance`` on the
layouts each bug lists). Run from the repository root::

    python bench/bug_corpus.py                  # every bug, 5 seeds
    python bench/bug_corpus.py --layer request  # the request layer only
    python bench/bug_corpus.py --seeds 3 --only stale-hash-on-reuse

For each bug it prints:

* ``ci``: whether the derandomized ``ci`` profile finds it (what CI runs), and
  its wall time including shrinking;
* ``time`` and ``steps``: the median, over ``--seeds`` seeds, of the wall
  time and of the number of operations executed (pool operations, or manager
  operations for the request layer, summed over every program run) until
  the first failing program is complete. These runs use
  the ``mutation`` profile (no shrinking, no example database) with
  ``max_examples`` raised to ``--budget`` and a seed each, so they stop at the
  first failure; ``found`` counts the seeds that found it within the budget;
* ``black-box``: whether ``ci`` still finds it when the target hides its
  ``snapshot()``, so only results, counts, usage and events can show the bug;
* ``CLI`` (request layer): the exit code and wall time of ``kvpool check --layer
  request --target tests.corpus.request_bugs:NAME --hypothesis-profile ci`` in a
  fresh process (1: it diverges; the time includes starting the interpreter).

``--detection`` prints another table instead (docs/verification.md, "Time to
detection"): for every bug of both layers, over ``--seeds`` seeds (20 for the
published table), how many runs of the default profile (``dev``) and of
``ci`` find it, and the median and worst seconds until the first failing
program ends (the report's ``seconds_to_first_failure``; target import
excluded). The runs are the profiles' own, with their own example budgets,
minus shrinking and the example database: neither changes when the first
failure happens, and a saved failure would make every later run find it at
once. ``--profiles dev`` (or ``ci``) measures one of the two only.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import Phase
from hypothesis import settings as Settings

from kvpool.model import PoolConfig
from kvpool.specs.conformance import run_conformance
from kvpool.specs.pool.target import OPERATIONS as POOL_OPERATIONS
from kvpool.specs.request.check import run_request_conformance
from kvpool.specs.request.target import LAYOUTS, ManagerSetup
from kvpool.specs.request.target import OPERATIONS as REQUEST_OPERATIONS
from tests.corpus.bugs import BUGS, Bug, target_of
from tests.corpus.request_bugs import CACHING, REQUEST_BUGS, RequestBug, cli_target, spec_of
from tests.corpus.request_bugs import target_of as manager_target_of

# Steps count the pool operations that change or read the pool's state, not its
# two counters or the snapshot the checker takes itself.
OPERATIONS = frozenset(POOL_OPERATIONS) - {"get_num_free_blocks", "get_usage", "snapshot"}

# Likewise for the manager: its block tables, counters, usage and snapshot are
# what the checker reads after every step.
MANAGER_OPERATIONS = frozenset(REQUEST_OPERATIONS) - {
    "get_block_ids",
    "usage",
    "num_free_blocks",
    "snapshot",
}


class Counting:
    """A target that counts the operations sent to it; optionally without snapshot()."""

    def __init__(
        self,
        inner: Any,
        counts: list[int],
        snapshot: bool,
        operations: frozenset[str] = OPERATIONS,
    ) -> None:
        self._inner = inner
        self._counts = counts
        self._snapshot = snapshot
        self._operations = operations

    def __getattr__(self, name: str) -> Any:
        if name == "snapshot" and not self._snapshot:
            raise AttributeError(name)
        attribute = getattr(self._inner, name)
        if name in self._operations:
            counts = self._counts

            def counted(*args: Any, **kwargs: Any) -> Any:
                counts[-1] += 1
                return attribute(*args, **kwargs)

            return counted
        return attribute


class Probe:
    """A factory that records, per program, the operations run and when it started."""

    def __init__(self, bug: Bug, snapshot: bool = True) -> None:
        self.make = target_of(bug.pool)
        self.snapshot = snapshot
        self.counts: list[int] = []
        self.starts: list[float] = []

    def __call__(self, config: PoolConfig) -> Counting:
        self.counts.append(0)
        self.starts.append(time.perf_counter())
        return Counting(self.make(config), self.counts, self.snapshot)


class ManagerProbe:
    """Probe's counterpart for the request layer: a factory of counted manager targets."""

    def __init__(self, bug: RequestBug, snapshot: bool = True) -> None:
        self.make = manager_target_of(bug.manager)
        self.snapshot = snapshot
        self.counts: list[int] = []
        self.starts: list[float] = []

    def __call__(self, setup: ManagerSetup) -> Counting:
        self.counts.append(0)
        self.starts.append(time.perf_counter())
        return Counting(self.make(setup), self.counts, self.snapshot, MANAGER_OPERATIONS)


def first_failure(bug: Bug, seed: int, budget: int) -> tuple[bool, float, int, int]:
    """(found, seconds, operations, programs) until the first failing program ends."""
    probe = Probe(bug)
    started = time.perf_counter()
    report = run_conformance(
        probe, level=bug.level, hypothesis_profile="mutation", seed=seed, max_examples=budget
    )
    if report.conforms:
        return False, time.perf_counter() - started, sum(probe.counts), len(probe.counts)
    # Hypothesis replays the failing program once more to report it: the last
    # program run is that replay, the one before it the first failure.
    done = probe.starts[-1]
    return True, done - started, sum(probe.counts[:-1]), len(probe.counts) - 1


def first_request_failure(bug: RequestBug, seed: int, budget: int) -> tuple[bool, float, int, int]:
    """first_failure for a request-layer bug: manager operations until the first failure."""
    probe = ManagerProbe(bug)
    started = time.perf_counter()
    report = run_request_conformance(
        spec_of(bug, probe), hypothesis_profile="mutation", seed=seed, max_examples=budget
    )
    if report.conforms:
        return False, time.perf_counter() - started, sum(probe.counts), len(probe.counts)
    done = probe.starts[-1]
    return True, done - started, sum(probe.counts[:-1]), len(probe.counts) - 1


def summary(runs: list[tuple[bool, float, int, int]]) -> dict[str, Any]:
    """How many seeds found the bug, and the medians over those that did."""
    found = [r for r in runs if r[0]]
    return {
        "found": len(found),
        "seconds": statistics.median(r[1] for r in found) if found else None,
        "steps": statistics.median(r[2] for r in found) if found else None,
        "programs": statistics.median(r[3] for r in found) if found else None,
    }


ROOT = Path(__file__).resolve().parent.parent


def cli_check(target: str) -> tuple[int, float]:
    """``kvpool check --layer request --target TARGET`` with ``ci``: (exit code, seconds)."""
    kvpool = Path(sys.executable).with_name("kvpool")
    with tempfile.TemporaryDirectory() as regression:
        started = time.perf_counter()
        result = subprocess.run(
            [
                str(kvpool),
                *("check", "--layer", "request", "--target", target),
                *("--hypothesis-profile", "ci", "--regression-dir", regression),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            check=False,
        )
        return result.returncode, time.perf_counter() - started


def measure_request(bug: RequestBug, seeds: int, budget: int) -> dict[str, Any]:
    cli_exit, cli_seconds = cli_check(cli_target(bug))
    started = time.perf_counter()
    ci = run_request_conformance(spec_of(bug), hypothesis_profile="ci")
    ci_seconds = time.perf_counter() - started
    runs = [first_request_failure(bug, seed, budget) for seed in range(seeds)]
    blind = run_request_conformance(
        spec_of(bug, ManagerProbe(bug, snapshot=False)), hypothesis_profile="ci"
    )
    return {
        "bug": bug.name,
        "layouts": _layouts(bug.layouts),
        "upstream": bug.upstream,
        "ci": not ci.conforms,
        "ci_seconds": ci_seconds,
        **summary(runs),
        "black_box": not blind.conforms,
        "cli": f"{cli_exit}, {cli_seconds:.1f} s",
    }


def _layouts(layouts: tuple[str, ...]) -> str:
    if layouts == LAYOUTS:
        return "all"
    if layouts == CACHING:
        return "caching"
    return ", ".join(layouts)


def measure(bug: Bug, seeds: int, budget: int) -> dict[str, Any]:
    started = time.perf_counter()
    ci = run_conformance(target_of(bug.pool), level=bug.level, hypothesis_profile="ci")
    ci_seconds = time.perf_counter() - started
    runs = [first_failure(bug, seed, budget) for seed in range(seeds)]
    found = [r for r in runs if r[0]]
    blind = run_conformance(Probe(bug, snapshot=False), level=bug.level, hypothesis_profile="ci")
    return {
        "bug": bug.name,
        "level": bug.level,
        "upstream": bug.upstream,
        "ci": not ci.conforms,
        "ci_seconds": ci_seconds,
        "found": len(found),
        "seconds": statistics.median(r[1] for r in found) if found else None,
        "steps": statistics.median(r[2] for r in found) if found else None,
        "programs": statistics.median(r[3] for r in found) if found else None,
        "black_box": not blind.conforms,
    }


def table(rows: list[dict[str, Any]], seeds: int, scope: str = "level") -> str:
    """The markdown table; ``scope`` is the second column (``level`` or ``layouts``)."""
    cli = any("cli" in r for r in rows)
    lines = [
        f"| bug | {scope} | upstream | ci finds | ci s | found/{seeds} | median s | "
        "median steps | median programs | black-box ci |" + (" CLI exit, time |" if cli else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if cli else ""),
    ]
    for r in rows:

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        lines.append(
            f"| {r['bug']} | {r[scope]} | {r['upstream']} | {'yes' if r['ci'] else 'NO'} | "
            f"{r['ci_seconds']:.1f} | {r['found']} | {num(r['seconds'], '.2f')} | "
            f"{num(r['steps'], '.0f')} | {num(r['programs'], '.0f')} | "
            f"{'yes' if r['black_box'] else 'no'} |" + (f" {r['cli']} |" if cli else "")
        )
    return "\n".join(lines)


FIRST_FAILURE = [Phase.explicit, Phase.generate, Phase.target]
"""The phases up to the first failure: shrinking only starts after it."""

DETECTION_PROFILES = ("dev", "ci")


def first_failure_profile(name: str) -> str:
    """Register and return ``name`` without shrinking or example database."""
    first = f"{name}-first-failure"
    base = Settings.get_profile(name)
    Settings.register_profile(first, base, database=None, phases=FIRST_FAILURE)
    return first


class CpuClock:
    """A target factory that notes this process's CPU time whenever a program starts."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.starts: list[float] = []

    def __call__(self, config: Any) -> Any:
        self.starts.append(time.process_time())
        return self.make(config)


def detections(bug: Bug | RequestBug, profile: str, seeds: int) -> list[tuple[float, float] | None]:
    """Per seed: (wall, CPU) seconds to the first failing program, or None for a miss.

    The machine is shared: wall time grows with its load, CPU time hardly. Without
    shrinking the program after the first failing one is Hypothesis's replay of
    it, so CPU time at the replay's start is the CPU time to the first failure.
    """
    chosen = first_failure_profile(profile)
    times: list[tuple[float, float] | None] = []
    for seed in range(seeds):
        started = time.process_time()
        if isinstance(bug, Bug):
            clock = CpuClock(target_of(bug.pool))
            report = run_conformance(clock, level=bug.level, hypothesis_profile=chosen, seed=seed)
        else:
            clock = CpuClock(manager_target_of(bug.manager))
            report = run_request_conformance(
                spec_of(bug, clock), hypothesis_profile=chosen, seed=seed
            )
        if report.failure_kind == "target-error":
            print(f"  {bug.name} seed {seed}: target error: {report.failure}", file=sys.stderr)
        if report.conforms or report.seconds_to_first_failure is None:
            times.append(None)
        else:
            times.append((report.seconds_to_first_failure, clock.starts[-1] - started))
    return times


def detection_table(
    bugs: list[Bug | RequestBug], seeds: int, profiles: tuple[str, ...] = DETECTION_PROFILES
) -> str:
    head = "| bug | layer |"
    rule = "| --- | --- |"
    for profile in profiles:
        head += f" {profile} found/{seeds} | {profile} median s (CPU) | {profile} worst s (CPU) |"
        rule += " --- | --- | --- |"
    lines = [head, rule]
    for bug in bugs:
        row = f"| {bug.name} | {'pool' if isinstance(bug, Bug) else 'request'} |"
        for profile in profiles:
            times = detections(bug, profile, seeds)
            found = [t for t in times if t is not None]
            median = "-"
            if found:
                wall = statistics.median(t[0] for t in found)
                median = f"{wall:.2f} ({statistics.median(t[1] for t in found):.2f})"
            worst = "-"
            if found:
                worst = f"{max(t[0] for t in found):.2f} ({max(t[1] for t in found):.2f})"
            row += f" {len(found)} | {median} | {worst} |"
        lines.append(row)
        print(row, file=sys.stderr, flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--detection", action="store_true", help="time to first failure under dev and ci"
    )
    parser.add_argument(
        "--profiles",
        nargs="+",
        choices=DETECTION_PROFILES,
        default=list(DETECTION_PROFILES),
        help="with --detection: the profiles measured",
    )
    parser.add_argument("--budget", type=int, default=2000, help="max programs per seeded run")
    parser.add_argument("--only", nargs="*", help="bug names (of either layer)")
    parser.add_argument(
        "--layer", choices=("pool", "request", "all"), default="all", help="which corpus"
    )
    args = parser.parse_args()
    names = set(args.only or ())
    pool_bugs = [b for b in BUGS if args.layer != "request" and (not names or b.name in names)]
    request_bugs = [
        b for b in REQUEST_BUGS if args.layer != "pool" and (not names or b.name in names)
    ]
    if args.detection:
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        print(detection_table([*pool_bugs, *request_bugs], args.seeds, tuple(args.profiles)))
        print(
            f"\n{started}, {platform.node()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}; load average {load} at start, "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at end"
        )
        return
    rows = []
    for bug in pool_bugs:
        rows.append(measure(bug, args.seeds, args.budget))
        print(f"measured {bug.name}", file=sys.stderr, flush=True)
    request_rows = []
    for request_bug in request_bugs:
        request_rows.append(measure_request(request_bug, args.seeds, args.budget))
        print(f"measured {request_bug.name}", file=sys.stderr, flush=True)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    if rows:
        print(table(rows, args.seeds))
    if rows and request_rows:
        print()
    if request_rows:
        print(table(request_rows, args.seeds, scope="layouts"))


if __name__ == "__main__":
    main()
