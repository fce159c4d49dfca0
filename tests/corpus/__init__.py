"""The bug corpus: planted bugs the conformance checks must find."""

import re

PLANTED_CODE_CRASH = re.compile(
    r"raises (TypeError|ValueError|AttributeError|NameError|UnboundLocalError)\("
)
"""How a failure reads when the planted class itself crashed (a wrong signature, a bad
unpacking, a missing name): a divergence, but not the one the bug plants. Two request-layer
bugs were "found" that way until 2026-11-29 (docs/verification.md, time to detection)."""


def assert_found_by_what_it_plants(name: str, failure: str) -> None:
    """The failing program shows the planted behaviour, not a crash of the planted code."""
    crash = PLANTED_CODE_CRASH.search(failure)
    assert crash is None, f"{name} was found only because its own code crashed: {failure}"
