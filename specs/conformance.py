"""``kvpool.specs.conformance``: the path the README and docs gave ``run_conformance``; kept.

New code imports from ``kvpool.specs`` (the public face) or from the layer's
own ``check`` module (``kvpool.specs.pool.check``).
"""

from kvpool.specs.pool.check import run_conformance
from kvpool.specs.runner.report import ConformanceReport
from kvpool.specs.runner.run import machine_test

__all__ = ["ConformanceReport", "machine_test", "run_conformance"]
