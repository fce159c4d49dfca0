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
from kvpool.specs.protocol import request_codec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.request.invariants import KVTruth, target_hashes_name_prefixes
from kvpool.specs.request.record import build
from kvpool.specs.request.target import ManagerFactory
from kvpool.specs.targets import TargetSpecError, resolve, resolve_target
from kvpool.specs.vectors import request_replay
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


class RequestReplay:
    """Replays a request-layer program on a manager target, step by step.

    What request-layer regression tests use; each mismatch is an
    AssertionError naming the step. ``hashes`` asks a target that hashes
    requests itself for its hashes of one, and checks them against the
    token ground truth of every request hashed so far.
    """

    def __init__(self, target: str | ManagerFactory, setup: dict[str, Json]) -> None:
        if isinstance(target, str):
            factory = resolve("request", target).factory
            if factory is None:
                raise TargetSpecError(f"{target} runs in its own interpreter: replay it there")
        else:
            factory = target
        self.setup = request_codec.decode_setup(setup)
        self.target = build(factory, self.setup)
        self.truth = KVTruth()
        self.steps = 0

    def step(
        self, op: str, args: dict[str, Json], ok: Json = _UNSET, error: str | None = None
    ) -> None:
        """Run ``op``: it must return ``ok``, or be rejected with ``error``."""
        __tracebackhide__ = True
        self.steps += 1
        expect = {"error": error} if error is not None else {"ok": None if ok is _UNSET else ok}
        problem = request_replay.check_manager_step(
            self.target, {"op": op, "args": args, "expect": expect}
        )
        if problem is not None:
            raise AssertionError(f"step {self.steps}, {op} {json.dumps(args)}: {problem}")

    def hashes(self, request: dict[str, Json]) -> None:
        """A target hashing itself: its hashes of ``request`` name prefixes as the tokens do."""
        __tracebackhide__ = True
        hasher = getattr(self.target, "block_hashes", None)
        if hasher is None:
            return
        decoded = request_codec.decode_request(request)
        self.truth.learn_hashes(decoded)
        reason = target_hashes_name_prefixes(self.truth, decoded, tuple(hasher(decoded)))
        if reason is not None:
            raise AssertionError(f"after step {self.steps}: {reason}")

    def expect_state(self, state: dict[str, Json]) -> None:
        """The target's whole state must be ``state`` (checked if it has ``snapshot()``)."""
        __tracebackhide__ = True
        problem = request_replay.state_problem(self.target, state)
        if problem is not None:
            raise AssertionError(f"after step {self.steps}: {problem}")
