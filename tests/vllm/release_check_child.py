"""Run in a child interpreter that imports a cached vLLM release (``python THIS VERSION``).

Checks the release end to end as the matrix does (bench/vllm_matrix.py), on few
programs: level 1 with caching on and off, with the workarounds of the release's
known level-1 bugs; level 2 with the known findings stepped over. Prints one JSON
line; exit 0 only when every run conformed.
"""

import json
import sys


def main(version: str) -> int:
    from kvpool.specs.targets.vllm.releases import activate_release, profile_for_release

    activate_release(version)
    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.runner import settings as _registered  # noqa: F401  (the ci profile)
    from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS
    from kvpool.specs.targets.vllm.pool import VllmTargetFactory, load_vllm

    api = load_vllm()
    workarounds = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else []
    result: dict[str, object] = {
        "version": api.version,
        "hash_tuple": getattr(api.hash_tuple, "__name__", None),
        "groups": api.groups,
        "hashes_as_argument": api.hashes_as_argument,
        "unsupported": sorted(api.unsupported_operations()),
    }
    runs = {}
    for level, caching in ((1, True), (1, False), (2, True)):
        factory = VllmTargetFactory(
            workarounds=workarounds, suppress=list(KNOWN_FINDINGS) if level == 2 else ()
        )
        report = run_conformance(
            factory,
            level=level,
            profile=profile_for_release(version),
            caching=(caching,),
            target_name=version,
            hypothesis_profile="ci",
            max_examples=40,
        )
        runs[f"level {level} caching={caching}"] = {
            "conforms": report.conforms,
            "examples": report.examples_run,
            "failure": (report.failure or "").splitlines()[:1],
        }
    result["runs"] = runs
    print(json.dumps(result))
    return 0 if all(r["conforms"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
