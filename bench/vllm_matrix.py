"""The conformance matrix of vLLM releases: which profile each follows, and its findings.

Run it with an interpreter that has vLLM's dependencies and kvpool installed
(vLLM itself need not be the release under test)::

    /path/to/vllm-venv/bin/python bench/vllm_matrix.py                 # every release
    /path/to/vllm-venv/bin/python bench/vllm_matrix.py 0.23.0 0.24.0   # some
    ... --examples 100 --jobs 2 --output results.json
    ... --render results.json                                          # the table again

For each release the wheel's sources are fetched once into the kvpool cache
(``kvpool.specs.targets.vllm.releases``) and a child interpreter imports that
release and runs, with the ``ci`` Hypothesis profile:

* level 1 with the release's expected profile, caching on and off, with
  shrinking (the programs printed are minimal); if it diverges, again with
  the fewest known-bug workarounds (``WORKAROUNDS``) that make it conform,
  so that what lies behind a release's first bug is checked too;
* level 1 with every other profile and those workarounds, without
  shrinking: only whether it conforms;
* level 2 with the expected profile, without shrinking, stepping over each
  rejection mismatch once found (``survey_level2``), so every one is listed.

The results are written as JSON (``--output``) and printed as a Markdown
table for docs/vllm-conformance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

RELEASES = [
    "0.8.5",
    "0.9.0",
    "0.9.1",
    "0.9.2",
    "0.10.0",
    "0.10.1",
    "0.10.2",
    *(f"0.{minor}.0" for minor in range(11, 34)),
    "0.27.1",
]
"""Every minor release from 0.8.5 (the first in the list has a v1 block pool), plus 0.27.1."""


# --------------------------------------------------------------------------
# The child: one release, imported in this interpreter
# --------------------------------------------------------------------------


def _summary(report: Any) -> dict[str, Any]:
    return {
        "conforms": report.conforms,
        "failure_kind": report.failure_kind,
        "failure": (report.failure or "").splitlines()[0] if report.failure else None,
        "program": report.program,
        "examples": report.examples_run,
        "seconds": round(report.seconds, 1),
    }


def run_child(version: str, examples: int) -> dict[str, Any]:
    """Everything the matrix wants to know about the importable release ``version``."""
    from hypothesis import Phase, settings

    from kvpool.model import PROFILES
    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.errors import TargetError
    from kvpool.specs.runner import settings as _registered  # noqa: F401  (the ci profile)
    from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS, classify_divergence
    from kvpool.specs.targets.vllm.pool import WORKAROUNDS, VllmTargetFactory, load_vllm
    from kvpool.specs.targets.vllm.releases import activate_release, profile_for_release
    from kvpool.specs.targets.vllm.survey import survey_level2

    settings.register_profile(
        "matrix-explore",
        settings.get_profile("ci"),
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    activate_release(version)
    result: dict[str, Any] = {"version": version, "expected_profile": profile_for_release(version)}
    try:
        api = load_vllm()
    except TargetError as error:
        result["error"] = str(error)
        return result
    result["imported_version"] = api.version
    result["left_out"] = sorted(api.unsupported_operations())

    def check(
        profile: str, caching: bool, workarounds: tuple[str, ...], shrink: bool
    ) -> dict[str, Any]:
        report = run_conformance(
            VllmTargetFactory(workarounds=workarounds),
            level=1,
            profile=profile,
            caching=(caching,),
            target_name=version,
            hypothesis_profile="ci" if shrink else "matrix-explore",
            max_examples=examples,
        )
        return _summary(report)

    # The expected profile, shrunk; then the fewest workarounds that make it conform.
    expected = result["expected_profile"]
    level1: dict[str, Any] = {}
    chosen: tuple[str, ...] = ()
    for caching in (True, False):
        level1[f"{expected} caching={'on' if caching else 'off'}"] = check(
            expected, caching, (), shrink=True
        )
    if not all(e["conforms"] for e in level1.values()):
        # All workarounds first; then drop each one the release conforms without,
        # in catalogue order: a minimal set (len(WORKAROUNDS) + 1 runs, not 2**n).
        def conforms_with(combination: tuple[str, ...]) -> bool:
            runs = {
                f"{expected} caching={'on' if c else 'off'}": check(
                    expected, c, combination, shrink=True
                )
                for c in (True, False)
            }
            for key, entry in runs.items():
                level1[key][f"with {'+'.join(combination)}"] = entry
            return all(e["conforms"] for e in runs.values())

        candidate = tuple(WORKAROUNDS)
        if conforms_with(candidate):
            for workaround in WORKAROUNDS:
                fewer = tuple(w for w in candidate if w != workaround)
                if fewer and conforms_with(fewer):
                    candidate = fewer
            chosen = candidate
    result["workarounds"] = list(chosen)

    # The other profiles, with the same workarounds, not shrunk: do they conform?
    for profile in PROFILES:
        if profile == expected:
            continue
        for caching in (True, False):
            level1[f"{profile} caching={'on' if caching else 'off'}"] = check(
                profile, caching, chosen, shrink=False
            )
    result["level1"] = level1

    # Level 2, stepping over each rejection mismatch; a wrong state or result
    # stops a survey, and is looked past with one more workaround if one helps.
    started = time.perf_counter()
    surveys: list[dict[str, Any]] = []
    for extra in [(), *((w,) for w in WORKAROUNDS if w not in chosen)]:
        found, last = survey_level2(
            VllmTargetFactory(workarounds=(*chosen, *extra)),
            step_over_new=True,
            profile=expected,
            target_name=version,
            hypothesis_profile="matrix-explore",
            max_examples=examples,
        )
        surveys.append(
            {
                "workarounds": [*chosen, *extra],
                "findings": [
                    {
                        "operation": d.operation,
                        "model_error": d.model_error,
                        "vllm": d.vllm_reaction,
                        "known": d.finding.key if d.finding else None,
                    }
                    for d in found
                ],
                "last": _summary(last),
            }
        )
        if last.conforms or classify_divergence(last.failure) is not None:
            break
    if not surveys[-1]["last"]["conforms"] and len(surveys) > 1:
        # no workaround helped: report the first survey's stop, shrunk
        surveys = surveys[:1]
    stop = surveys[0]["last"]
    if not stop["conforms"] and classify_divergence(stop["failure"]) is None:
        shrunk = run_conformance(
            VllmTargetFactory(
                workarounds=chosen,
                suppress=[
                    *KNOWN_FINDINGS,
                    *(f"{f['operation']}:{f['model_error']}" for f in surveys[0]["findings"]),
                ],
            ),
            level=2,
            profile=expected,
            target_name=version,
            hypothesis_profile="ci",
            max_examples=examples,
        )
        surveys[0]["stop_shrunk"] = _summary(shrunk)
    result["level2"] = {
        "surveys": surveys,
        "findings": surveys[-1]["findings"],
        "last": surveys[-1]["last"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    return result


# --------------------------------------------------------------------------
# The parent: fetch, spawn, collect, print
# --------------------------------------------------------------------------


def run_release(version: str, examples: int) -> dict[str, Any]:
    """Fetch ``version`` and run the child for it; its result, or what went wrong."""
    from kvpool.specs.targets.vllm.releases import (
        ReleaseError,
        ensure_dependencies,
        ensure_release,
        release_environment,
    )

    started = time.perf_counter()
    try:
        ensure_release(version)
        ensure_dependencies(version)
    except ReleaseError as error:
        return {"version": version, "error": str(error)}
    command = [sys.executable, __file__, "--child", version, "--examples", str(examples)]
    done = subprocess.run(
        command, env=release_environment(version), capture_output=True, text=True, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"version": version, "error": done.stderr.strip()[-2000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    if result.get("imported_version") != version:
        # A broken cache entry (no vllm/__init__.py) lets the installed vLLM through.
        found = result.get("imported_version")
        return {"version": version, "error": f"the child imported vLLM {found}, not {version}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _verdict(entry: dict[str, Any], workarounds: list[str]) -> str:
    if entry.get("conforms"):
        return "conforms"
    again = entry.get(f"with {'+'.join(workarounds)}") if workarounds else None
    if isinstance(again, dict) and again.get("conforms"):
        return f"conforms with {'+'.join(workarounds)}"
    return "diverges"


def markdown(results: list[dict[str, Any]]) -> str:
    """The matrix as a Markdown table, one row per release."""
    from kvpool.specs.targets.vllm.findings import known_finding

    rows = [
        "| release | left out | expected profile | level 1 | level 2 findings |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['version']} | | | not run: {r['error'][:80]} | |")
            continue
        level1 = r["level1"]
        chosen = r.get("workarounds", [])
        verdicts = "; ".join(f"{p}: {_verdict(e, chosen)}" for p, e in level1.items())
        conforming = [
            p
            for p in dict.fromkeys(k.split()[0] for k in level1)
            if all(
                _verdict(e, chosen) != "diverges" for k, e in level1.items() if k.split()[0] == p
            )
        ]
        verdicts = f"**{', '.join(conforming) or 'none'}** ({verdicts})"
        findings = r["level2"]["findings"]
        known = []
        for f in findings:  # classified again: the catalogue may have grown since the run
            finding = known_finding(f["operation"], f["model_error"], f["vllm"])
            known.append(
                finding.key if finding else f"NEW {f['operation']}/{f['model_error']}/{f['vllm']}"
            )
        surveys = r["level2"].get("surveys", [])
        extra = surveys[-1]["workarounds"] if surveys else []
        tail = "" if r["level2"]["last"]["conforms"] else " (stopped: see below)"
        if len(surveys) > 1:
            stop = surveys[0].get("stop_shrunk") or surveys[0]["last"]
            tail += (
                f"; first stopped by a wrong state or result ({(stop['failure'] or '')[:60]}...), "
                f"then surveyed with {'+'.join(extra)}"
            )
        rows.append(
            f"| {r['version']} | {', '.join(r['left_out']) or '-'} | {r['expected_profile']} "
            f"| {verdicts} | {len(findings)}: {', '.join(known)}{tail} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", default=RELEASES)
    parser.add_argument("--examples", type=int, default=150, help="programs per run")
    parser.add_argument("--jobs", type=int, default=1, help="releases checked at once")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, default=None, help="print the table of a JSON")
    args = parser.parse_args()

    if args.render:
        print(markdown(json.loads(args.render.read_text())))
        return
    if args.child:
        print(json.dumps(run_child(args.child, args.examples)))
        return

    def one(version: str) -> dict[str, Any]:
        result = run_release(version, args.examples)
        print(f"{version}: done in {result.get('seconds', '?')} s", file=sys.stderr, flush=True)
        if args.output is not None:
            partial = args.output.with_suffix(f".{version}.json")
            partial.write_text(json.dumps(result, indent=2))
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, args.releases))
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2))
    print(markdown(results))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
