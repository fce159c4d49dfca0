"""The conformance matrix of vLLM releases: which profile each follows, and its findings.

Run it with an interpreter that has vLLM's dependencies and kvpool installed
(vLLM itself need not be the release under test)::

    /path/to/vllm-venv/bin/python bench/vllm_matrix.py                 # every release
    /path/to/vllm-venv/bin/python bench/vllm_matrix.py 0.23.0 0.24.0   # some
    ... --examples 100 --jobs 2 --output results.json

For each release the wheel's sources are fetched once into the kvpool cache
(``kvpool.specs.vllm_releases``) and a child interpreter imports that
release and runs, with the ``ci`` Hypothesis profile:

* level 1 against every semantics profile, the release's expected one
  first; when a profile fails on a known level-1 bug the adapter can step
  around (``WORKAROUNDS``), that profile is tried again with the workaround;
* level 2 with the expected profile, stepping over each rejection mismatch
  once found (``survey_level2``), so every one is listed.

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
    from kvpool.model import PROFILES
    from kvpool.specs.adapters.vllm_target import (
        WORKAROUNDS,
        TargetError,
        VllmTargetFactory,
        install_operation_filter,
        load_vllm,
        survey_level2,
    )
    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.vllm_releases import activate_release, profile_for_release

    activate_release(version)
    install_operation_filter()
    result: dict[str, Any] = {"version": version, "expected_profile": profile_for_release(version)}
    try:
        api = load_vllm()
    except TargetError as error:
        result["error"] = str(error)
        return result
    result["imported_version"] = api.version
    result["left_out"] = sorted(api.unsupported_operations())
    options: dict[str, Any] = {"hypothesis_profile": "ci", "max_examples": examples}

    expected = result["expected_profile"]
    order = [expected, *(p for p in PROFILES if p != expected)]
    level1: dict[str, Any] = {}
    for profile in order:
        for caching in (True, False):

            def check(
                workarounds: list[str], profile: str = profile, caching: bool = caching
            ) -> Any:
                return run_conformance(
                    VllmTargetFactory(workarounds=workarounds),
                    level=1,
                    profile=profile,
                    caching=(caching,),
                    target_name=version,
                    **options,
                )

            report = check([])
            entry = _summary(report)
            if not report.conforms and report.failure_kind != "target-error":
                for workaround in WORKAROUNDS:
                    entry[f"with {workaround}"] = _summary(check([workaround]))
            level1[f"{profile} caching={'on' if caching else 'off'}"] = entry
    result["level1"] = level1

    workarounds = [
        w
        for w in WORKAROUNDS
        if any(e.get(f"with {w}", {}).get("conforms") for e in level1.values())
    ]
    started = time.perf_counter()
    found, last = survey_level2(
        VllmTargetFactory(workarounds=workarounds),
        step_over_new=True,
        profile=expected,
        target_name=version,
        **options,
    )
    result["level2"] = {
        "workarounds": workarounds,
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
        "seconds": round(time.perf_counter() - started, 1),
    }
    return result


# --------------------------------------------------------------------------
# The parent: fetch, spawn, collect, print
# --------------------------------------------------------------------------


def run_release(version: str, examples: int) -> dict[str, Any]:
    """Fetch ``version`` and run the child for it; its result, or what went wrong."""
    from kvpool.specs.vllm_releases import (
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
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _verdict(entry: dict[str, Any]) -> str:
    if entry.get("conforms"):
        return "conforms"
    for key, again in entry.items():
        if key.startswith("with ") and isinstance(again, dict) and again.get("conforms"):
            return f"conforms {key}"
    return "diverges"


def markdown(results: list[dict[str, Any]]) -> str:
    """The matrix as a Markdown table, one row per release."""
    rows = [
        "| release | left out | expected profile | level 1 | level 2 findings |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['version']} | | | not run: {r['error'][:80]} | |")
            continue
        level1 = r["level1"]
        verdicts = "; ".join(f"{p}: {_verdict(e)}" for p, e in level1.items())
        conforming = [
            p
            for p in dict.fromkeys(k.split()[0] for k in level1)
            if all(_verdict(e) != "diverges" for k, e in level1.items() if k.split()[0] == p)
        ]
        verdicts = f"**{', '.join(conforming) or 'none'}** ({verdicts})"
        findings = r["level2"]["findings"]
        known = [f["known"] or f"NEW {f['operation']}/{f['model_error']}" for f in findings]
        tail = "" if r["level2"]["last"]["conforms"] else " (stopped: see JSON)"
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
    args = parser.parse_args()

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
