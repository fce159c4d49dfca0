"""How fast the radix layer's checks find each bug of the SGLang corpus, in each tree core.

The corpus (tests/sglang/bugs.py) plants SGLang's radix-cache bug history into
SGLang 0.5.23's own classes. Run from the repository root, with SGLang
installed (docs/sglang-conformance.md)::

    python bench/sglang_corpus.py                 # every bug, every core, 5 seeds
    python bench/sglang_corpus.py --seeds 3 --only lock-skips-node

For each bug and core it prints a Markdown row:

* ``ci``: whether the derandomized ``ci`` profile finds it, its wall time
  including shrinking, and the number of calls in the shrunk program;
* ``found``, ``time``, ``programs``, ``steps``: over ``--seeds`` seeds of the
  ``mutation`` profile (no shrinking, a seed each, ``--budget`` programs),
  how many found it, and the medians of the wall time, of the programs run
  and of the cache operations sent until the first failing program ended;
* ``black-box ci``: whether ``ci`` still finds it when the target hides its
  ``snapshot()`` (results, sizes and events only).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool.model.radix import RadixConfig
from kvpool.specs.radix.check import check_radix
from kvpool.specs.targets.sglang.loading import load_sglang
from tests.sglang.bugs import BUGS, UPSTREAM_URLS, SglangBug

OPERATIONS = frozenset(
    {"insert", "match_prefix", "lock", "unlock", "evict", "reset", "take_events"}
)


class Counting:
    """A target that counts the cache operations sent to it; optionally without snapshot()."""

    def __init__(self, inner: Any, counts: list[int], snapshot: bool) -> None:
        self._inner = inner
        self._counts = counts
        self._snapshot = snapshot

    def __getattr__(self, name: str) -> Any:
        if name == "snapshot" and not self._snapshot:
            raise AttributeError(name)
        attribute = getattr(self._inner, name)
        if name not in OPERATIONS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[0] += 1
            return attribute(*args, **kwargs)

        return counted


def factory(bug: SglangBug, core: str, counts: list[int], snapshot: bool = True) -> Any:
    inner = bug.factory(core)

    def make(config: RadixConfig) -> Counting:
        return Counting(inner(config), counts, snapshot)

    return make


def run(bug: SglangBug, core: str, seeds: int, budget: int) -> dict[str, Any]:
    counts = [0]
    started = time.perf_counter()
    ci = check_radix(
        factory(bug, core, counts),
        bug.policy,
        1,
        hypothesis_profile="ci",
        events=bug.events,
        page_sizes=bug.page_sizes,
    )
    ci_seconds = time.perf_counter() - started
    calls = len((ci.program or "").splitlines()) - 1
    found, times, programs, steps = 0, [], [], []
    for seed in range(seeds):
        counts[0] = 0
        started = time.perf_counter()
        report = check_radix(
            factory(bug, core, counts),
            bug.policy,
            1,
            hypothesis_profile="mutation",
            max_examples=budget,
            seed=seed,
            events=bug.events,
            page_sizes=bug.page_sizes,
        )
        if not report.conforms:
            found += 1
            times.append(time.perf_counter() - started)
            programs.append(report.examples_run)
            steps.append(counts[0])
    blind = check_radix(
        factory(bug, core, [0], snapshot=False),
        bug.policy,
        1,
        hypothesis_profile="ci",
        shrink=False,  # only the verdict is reported
        events=bug.events,
        page_sizes=bug.page_sizes,
    )
    return {
        "ci": not ci.conforms,
        "ci_seconds": ci_seconds,
        "calls": calls,
        "found": found,
        "seconds": statistics.median(times) if times else None,
        "programs": statistics.median(programs) if programs else None,
        "steps": statistics.median(steps) if steps else None,
        "black_box": not blind.conforms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--only", action="append", default=None)
    args = parser.parse_args()
    api = load_sglang()
    print(
        f"SGLang {api.version}, {platform.machine()}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| bug | core | upstream | fixed in | ci finds | ci s | ci calls | found/"
        f"{args.seeds} | median s | median steps | median programs | black-box ci |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for bug in BUGS:
        if args.only and bug.name not in args.only:
            continue
        for core in bug.plants:
            r = run(bug, core, args.seeds, args.budget)
            link = (
                f"[{bug.upstream}]({UPSTREAM_URLS[bug.upstream]})" if bug.upstream != "-" else "-"
            )

            def fmt(value: float | None, digits: int = 0) -> str:
                return "-" if value is None else f"{value:.{digits}f}"

            print(
                f"| {bug.name} | {core} | {link} | {bug.fixed_in} | "
                f"{'yes' if r['ci'] else 'no'} | {r['ci_seconds']:.1f} | {r['calls']} | "
                f"{r['found']} | {fmt(r['seconds'], 2)} | {fmt(r['steps'])} | "
                f"{fmt(r['programs'])} | {'yes' if r['black_box'] else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
