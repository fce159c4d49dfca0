"""The runner every layer shares: run a machine, keep one report, render it.

* ``run``: ``run_machine`` (counting, time limits, how a run ended) and ``machine_test``;
* ``lockstep``: ``LockStep``, the model-then-target call every machine makes;
* ``report``: ``ConformanceReport`` and ``Counterexample``, plain data;
* ``render``: the report in a terminal, as JSON, as JUnit XML;
* ``settings``: the Hypothesis profiles (``ci``, ``dev``, ``deep``, ``fuzz``, ``mutation``);
* ``watchdog``: a time limit per program; ``database``: failures shared through Redis.
"""

from kvpool.specs.runner.report import BrokenInvariant, ConformanceReport, Counterexample
from kvpool.specs.runner.run import machine_test, run_machine

__all__ = ["BrokenInvariant", "ConformanceReport", "Counterexample", "machine_test", "run_machine"]
