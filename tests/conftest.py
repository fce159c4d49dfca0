"""Hypothesis settings for kvpool's own tests: ``ci`` under CI (derandomized), else ``dev``.

KVPOOL_HYPOTHESIS=deep pytest ... explores for longer.
"""

from hypothesis import settings

from kvpool.specs.runner.settings import default_profile_name

settings.load_profile(default_profile_name())
