"""Hypothesis settings profiles for conformance runs.

* ``ci``: derandomized and bounded: the same program every run, minutes at most.
* ``dev``: the local default: random, a few hundred programs, saved failures replayed.
* ``deep``: hours of exploration with long programs.
* ``fuzz``: unbounded, for long-running workers sharing an example database.
* ``mutation``: ``ci`` without shrinking or database, for mutation testing.

Loading one is the caller's choice (``settings.load_profile``); importing this
module only registers them. Where a profile with a database keeps its
examples is the runner's choice (``kvpool.specs.runner.database``): kvpool's
own directory per layer and target, never ``.hypothesis/`` in the working
directory.
"""

import os

from hypothesis import HealthCheck, Phase, settings

_BASE = settings(
    deadline=None,
    # The explain phase re-runs a failure many times to annotate it; our
    # reports say what went wrong themselves, so it only costs time.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    print_blob=True,
)

settings.register_profile(
    "ci", _BASE, derandomize=True, database=None, max_examples=150, stateful_step_count=40
)
settings.register_profile("dev", _BASE, max_examples=200, stateful_step_count=40)
settings.register_profile("deep", _BASE, max_examples=20_000, stateful_step_count=120)
settings.register_profile("fuzz", _BASE, max_examples=10**9, stateful_step_count=200)
# ci without shrinking and without the database: a failure is reported as soon
# as it is found. For mutation testing (KVPOOL_HYPOTHESIS=mutation, where only
# kill or survive matters) and for measuring time to the first failure
# (bench/bug_corpus.py, with a seed).
settings.register_profile(
    "mutation",
    _BASE,
    derandomize=True,
    database=None,
    max_examples=150,
    stateful_step_count=40,
    phases=[Phase.explicit, Phase.generate],
)

PROFILE_NAMES = ("ci", "dev", "deep", "fuzz", "mutation")


def default_profile_name() -> str:
    """``ci`` when the CI environment variable is set, else ``dev``; KVPOOL_HYPOTHESIS wins."""
    chosen = os.environ.get("KVPOOL_HYPOTHESIS")
    if chosen:
        return chosen
    return "ci" if os.environ.get("CI") else "dev"
