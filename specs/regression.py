"""Replaying a saved counterexample: what kvpool's generated regression tests import.

``kvpool check`` writes a pytest file for every divergence it finds
(``kvpool.specs.pool.counterexample.regression_test``); the file replays the
program on a target named by a target string, step by step, with ``Replay``.
This module is on the top floor of ``kvpool.specs`` because it resolves target
strings; its import path is part of every saved test, so it does not move.
"""

import json
from typing import Any

from kvpool.specs.pool.target import PoolTarget, TargetFactory
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json
from kvpool.specs.targets import resolve_target
from kvpool.specs.vectors.replay import check_step, state_problem

_UNSET: Any = object()


class Replay:
    """Replays a program on a target, step by step, against the model's answers.

    Generated regression tests use it; each mismatch is an AssertionError
    naming the step.
    """

    def __init__(self, target: str | TargetFactory, config: dict[str, Json]) -> None:
        factory = resolve_target(target) if isinstance(target, str) else target
        self.config = protocol.decode_config(config)
        self.target: PoolTarget = factory(self.config)
        self.steps = 0

    def step(
        self, op: str, args: dict[str, Json], ok: Json = _UNSET, error: str | None = None
    ) -> None:
        """Run ``op``: it must return ``ok``, or be rejected with ``error``."""
        __tracebackhide__ = True
        self.steps += 1
        expect = {"error": error} if error is not None else {"ok": None if ok is _UNSET else ok}
        problem = check_step(self.target, {"op": op, "args": args, "expect": expect})
        if problem is not None:
            raise AssertionError(f"step {self.steps}, {op} {json.dumps(args)}: {problem}")

    def expect_state(self, state: dict[str, Json]) -> None:
        """The target's whole state must be ``state`` (checked if it has ``snapshot()``)."""
        __tracebackhide__ = True
        found = state_problem(self.target, self.config, state)
        if found is not None:
            problem, diff = found
            raise AssertionError(f"after step {self.steps}: {problem}:\n{diff}")
