"""Hypothesis settings for kvpool's own tests: ``ci`` under CI (derandomized), else ``dev``.

KVPOOL_HYPOTHESIS=deep pytest ... explores for longer.
"""

import os

import pytest
from hypothesis import settings

from kvpool.specs.runner.settings import default_profile_name

settings.load_profile(default_profile_name())


@pytest.fixture(autouse=True)
def _patient_cmd_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give ``cmd:`` targets two minutes per answer unless a test sets its own wait.

    The kit waits 5 s by default. On CI's two shared cores a good answer (a Node.js
    target starting, a child interpreter importing) can take longer, and the kit would
    rightly call it a hang; the tests of hangs set a short ``KVPOOL_CMD_TIMEOUT`` of
    their own.
    """
    if "KVPOOL_CMD_TIMEOUT" not in os.environ:
        monkeypatch.setenv("KVPOOL_CMD_TIMEOUT", "120")
