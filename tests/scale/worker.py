"""One fuzzing worker, as a subprocess: a corpus bug checked with the shared database.

    KVPOOL_REDIS_URL=redis://127.0.0.1:PORT/0 KVPOOL_HYPOTHESIS_DIR=DIR \\
        python -m tests.scale.worker BUG {generate|reuse-only} SEED

prints one JSON line: whether the target conformed, the programs run, the
failing program.
"""

import json
import sys

from hypothesis import Phase, settings

from kvpool.specs.conformance import run_conformance
from kvpool.specs.runner.database import DatabaseChoice, database_for
from kvpool.specs.runner.settings import default_profile_name
from tests.corpus.bugs import BUGS, target_of


def main() -> None:
    # The seed names the worker only: a seeded run uses no example database.
    name, mode = sys.argv[1], sys.argv[2]
    bug = next(b for b in BUGS if b.name == name)
    notes: list[str] = []
    shared = database_for("pool", "target", DatabaseChoice.REDIS, notes)
    assert "Multiplexed" in type(shared).__name__, "KVPOOL_REDIS_URL did not reach the database"
    phases = [Phase.reuse] if mode == "reuse-only" else [Phase.reuse, Phase.generate, Phase.shrink]
    fuzz = settings.get_profile("fuzz")
    # A database in the profile tells the runner to use one (it picks kvpool's own for the
    # target, here the shared Redis): under CI the inherited default has none.
    settings.register_profile("worker", fuzz, phases=phases, max_examples=5000, database=shared)
    report = run_conformance(target_of(bug.pool), level=bug.level, hypothesis_profile="worker")
    if report.failure_kind == "nothing-ran":
        # reuse-only with nothing saved: Hypothesis has no program to run.
        print(json.dumps({"conforms": True, "examples_run": 0, "program": None}))
        return
    print(
        json.dumps(
            {
                "conforms": report.conforms,
                "examples_run": report.examples_run,
                "program": report.program,
                "failure_kind": report.failure_kind,
                "profile": default_profile_name(),
            }
        )
    )


if __name__ == "__main__":
    main()
