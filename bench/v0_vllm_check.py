"""Check vLLM's own v0 allocator (0.10.2) against kvpool's v0 model, in lock-step.

Run it with any interpreter that has kvpool installed; vLLM need not be
installed (the adapter loads the release's five block modules from kvpool's
release cache)::

    python bench/v0_vllm_check.py --fetch        # download 0.10.2's sources once
    python bench/v0_vllm_check.py                # engine discipline, then any
    python bench/v0_vllm_check.py --profile dev --examples 2000 --planted

What it runs, each with the Hypothesis profile given (``ci`` by default):

1. the model against itself (a smoke test of the machine);
2. vLLM under the ``engine`` discipline (what vLLM's block manager does): it
   must conform;
3. vLLM under the ``any`` discipline (every valid program): the machine
   finds vLLM's evictor bugs and prints the shrunk program
   (docs/semantics.md, "The v0 allocator");
4. with ``--planted``: the two bugs planted into vLLM's classes by
   ``tests/v0/vllm_planted.py``, each shrunk to a minimal program.

Exit code: 0 when vLLM conforms under the engine discipline, 1 when it does
not, 2 when vLLM's v0 allocator cannot be loaded. vLLM 0.10.2 hashes with
Python's ``hash()``; the script re-runs itself with ``PYTHONHASHSEED=0``
unless a seed is set, so runs are reproducible.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fetch", action="store_true", help="download 0.10.2's sources first")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (ci, dev, deep)")
    parser.add_argument("--examples", type=int, default=None, help="programs per run")
    parser.add_argument("--steps", type=int, default=None, help="steps per program")
    parser.add_argument("--planted", action="store_true", help="also shrink the planted bugs")
    args = parser.parse_args(argv)

    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    from kvpool.specs import ConformanceReport as V0Report
    from kvpool.specs.targets.vllm import v0 as vllm_v0_target
    from kvpool.specs.v0.check import check_v0
    from kvpool.specs.v0.model_target import ModelV0Target

    if args.fetch:
        from kvpool.specs.targets.vllm.releases import ensure_release

        print(f"fetching vLLM {vllm_v0_target.V0_RELEASE} (wheel, kept: Python sources only)")
        ensure_release(vllm_v0_target.V0_RELEASE, quiet=False)
    reason = vllm_v0_target.unavailable_reason()
    if reason is not None:
        print(f"kvpool: {reason}", file=sys.stderr)
        return 2
    print(f"vLLM's v0 allocator: {vllm_v0_target.load_v0().origin}")

    budget = {
        "hypothesis_profile": args.profile,
        "max_examples": args.examples,
        "steps": args.steps,
    }
    make_vllm = vllm_v0_target.make_vllm_v0_target

    def show(name: str, report: V0Report, expect_conform: bool) -> bool:
        verdict = "conforms" if report.conforms else f"diverges ({report.failure_kind})"
        ok = report.conforms == expect_conform
        mark = "ok" if ok else "UNEXPECTED"
        print(
            f"\n== {name} [{report.profiles[0]}]: {verdict}, {report.examples_run} programs, "
            f"{report.seconds:.1f} s: {mark}"
        )
        if not report.conforms:
            print((report.failure or "").split("\n\ncalls")[0])
            print("shrunk program:")
            print("\n".join(f"  {line}" for line in (report.program or "").splitlines()))
        return ok

    show("model", check_v0(ModelV0Target, "engine", **budget), True)
    show("model", check_v0(ModelV0Target, "any", **budget), True)
    engine_ok = show(
        "vLLM 0.10.2", check_v0(make_vllm, "engine", target_name="vllm", **budget), True
    )
    show("vLLM 0.10.2", check_v0(make_vllm, "any", target_name="vllm", **budget), False)

    if args.planted:
        sys.path.insert(0, str(ROOT))
        from tests.v0.vllm_planted import deduplication_bug, tie_break_bug

        for make_target in (deduplication_bug, tie_break_bug):
            report = check_v0(make_target, "engine", target_name=make_target.__name__, **budget)
            show(f"vLLM 0.10.2 with {make_target.__name__}", report, False)

    return 0 if engine_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
