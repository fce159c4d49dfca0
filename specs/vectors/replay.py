"""Replaying conformance vectors against a target, step by step.

Results are compared at every step, and the whole state too when the target
has ``snapshot()``. A target that crashes is a ``TargetError``, not a
mismatch; ``run_corpus`` stops at the first one.
"""

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from kvpool.model import PoolConfig, PoolError
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.pool.machine import state_diff
from kvpool.specs.pool.record import crash_message
from kvpool.specs.pool.target import PoolTarget, Snapshottable, TargetFactory
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json
from kvpool.specs.vectors.format import LoadedVector

# --------------------------------------------------------------------------
# Replaying vectors against a target
# --------------------------------------------------------------------------


@dataclass
class Mismatch:
    """Where a target parts from a vector."""

    vector: str
    where: str
    step: int
    """1-based; 0 when the pool could not even be built."""
    op: str
    args: dict[str, Json]
    problem: str
    diff: str | None = None

    def describe(self) -> str:
        head = (
            f"{self.where} {self.vector}: step {self.step}, "
            f"{self.op} {json.dumps(self.args, separators=(', ', ': '))}: {self.problem}"
        )
        return head if self.diff is None else f"{head}\n{self.diff}"


def same_result(op: str, expected: Json, actual: Json, target: object = None) -> bool:
    """Whether a target's JSON result counts as the model's (usage within 1e-9)."""
    if op == "get_usage":
        return (
            isinstance(actual, int | float)
            and not isinstance(actual, bool)
            and math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-9)
        )
    if op == "take_events":
        return bool(_normal_events(target, expected) == _normal_events(target, actual))
    return bool(expected == actual)


def _normal_events(target: object, events: Json) -> Json:
    normalize = getattr(target, "normalize_events", None)
    if normalize is None or not isinstance(events, list):
        return events
    try:
        decoded = [protocol.decode_event(e) for e in events]
    except protocol.ProtocolError:
        return events
    return [protocol.encode_event(e) for e in normalize(decoded)]


def state_of(target: object, config: PoolConfig) -> Json | None:
    """The target's state in canonical JSON (normalized), or None if it has no snapshot."""
    if not isinstance(target, Snapshottable):
        return None
    return normal_state(target, protocol.encode_state(target.snapshot()), config)


def normal_state(target: object, state: Json, config: PoolConfig) -> Json:
    """``state`` after the target's ``normalize_state`` hook, if it has one."""
    normalize = getattr(target, "normalize_state", None)
    if normalize is None:
        return state
    return protocol.encode_state(normalize(protocol.decode_state(state, config)))


def check_step(target: PoolTarget, step: dict[str, Json]) -> str | None:
    """Run one step on ``target``; None if it matches, else what went wrong."""
    op, args, expect = step["op"], step["args"], step["expect"]
    try:
        actual = protocol.apply(target, op, args)
    except PoolError as rejection:
        name = type(rejection).__name__
        if "error" not in expect:
            return (
                f"the model accepts it (returning {expect['ok']!r}), "
                f"the target rejects it with {name}: {rejection}"
            )
        if name != expect["error"]:
            return f"the model rejects it with {expect['error']}, the target with {name}"
        actual = None
    else:
        if "error" in expect:
            return (
                f"the model rejects it with {expect['error']}, "
                f"the target accepts it (returning {actual!r})"
            )
        if not same_result(op, expect["ok"], actual, target):
            return f"the model returns {expect['ok']!r}, the target returned {actual!r}"
    return None


def state_problem(target: PoolTarget, config: PoolConfig, expected: Json) -> tuple[str, str] | None:
    """(problem, side-by-side diff) if the target's state is not ``expected``."""
    actual = state_of(target, config)
    if actual is None:
        return None
    wanted = normal_state(target, expected, config)
    if actual == wanted:
        return None
    diff = state_diff(protocol.decode_state(wanted, config), protocol.decode_state(actual, config))
    return "the target's state differs from the model's", diff


def run_vector(factory: TargetFactory, vector: LoadedVector) -> Mismatch | None:
    """Replay one vector; None if the target matches it at every step.

    Results are compared at every step; the whole state too when the target
    has ``snapshot()``. TargetError propagates.
    """
    data = vector.data
    config = protocol.decode_config(data["config"])
    vid = str(data["id"])
    try:
        target = factory(config)
    except PoolError as error:
        return Mismatch(
            vid,
            vector.where,
            0,
            "new_pool",
            data["config"],
            f"the target cannot build the pool: {type(error).__name__}: {error}",
        )
    except TargetError:
        raise
    except Exception as error:  # the target's own bug: a target error, not a kit crash
        raise TargetError(crash_message("new_pool", data["config"], error)) from error
    for number, step in enumerate(data["steps"], 1):
        try:
            problem = check_step(target, step)
            state = None if problem is not None else state_problem(target, config, step["state"])
        except TargetError:
            raise
        except Exception as error:  # the target's own bug: a target error, not a kit crash
            raise TargetError(crash_message(step["op"], step["args"], error)) from error
        if problem is not None:
            return Mismatch(vid, vector.where, number, step["op"], step["args"], problem)
        if state is not None:
            return Mismatch(vid, vector.where, number, step["op"], step["args"], *state)
    return None


@dataclass
class RunResult:
    """The outcome of replaying a corpus."""

    run: int = 0
    passed: int = 0
    skipped: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    target_error: str | None = None
    skipped_kinds: set[tuple[int, str]] = field(default_factory=set)
    """The (level, profile) of the vectors skipped."""
    kept_mismatches: int = 20
    """How many mismatches are kept in full (the rest are only counted in ``failed``)."""
    failed: int = 0

    def replay(
        self, vector: LoadedVector, run: Callable[[], Mismatch | None], fail_fast: bool
    ) -> bool:
        """Run one chosen vector (``run``) and count its outcome; True when replay must stop.

        A target that errors or aborts stops the replay (its error is kept); a
        mismatch stops it only under ``fail_fast``. Every layer's replay counts here.
        """
        self.run += 1
        try:
            mismatch = run()
        except TargetError as error:
            self.target_error = f"{vector.where} {vector.data['id']}: {error}"
            return True
        except TargetAbort as abort:
            self.target_error = f"{vector.where} {vector.data['id']}: {abort.error}"
            return True
        if mismatch is None:
            self.passed += 1
            return False
        self.failed += 1
        if len(self.mismatches) < self.kept_mismatches:
            self.mismatches.append(mismatch)
        return fail_fast

    def why_nothing_ran(self, levels: Sequence[int] | None, profiles: Sequence[str] | None) -> str:
        """Why ``run`` is 0, in words (the corpus was empty, or every vector was filtered out)."""
        if not self.skipped:
            return "the vectors hold no vector at all"
        found = ", ".join(f"level {lv} {pr}" for lv, pr in sorted(self.skipped_kinds))
        return (
            f"none of the {self.skipped} vectors is of a chosen level and profile "
            f"(levels {list(levels) if levels is not None else 'any'}, profiles "
            f"{list(profiles) if profiles is not None else 'any'}); the vectors are: {found}"
        )


def run_corpus(
    factory: TargetFactory,
    vectors: Iterable[LoadedVector],
    levels: Sequence[int] | None = None,
    profiles: Sequence[str] | None = None,
    fail_fast: bool = False,
) -> RunResult:
    """Replay every vector whose level and profile are chosen; count what happened.

    ``vectors`` may be a stream (``format.scan``): each is dropped once run.
    """
    result = RunResult()
    for vector in vectors:
        config = vector.data["config"]
        if (levels is not None and vector.data["level"] not in levels) or (
            profiles is not None and config["profile"] not in profiles
        ):
            result.skipped += 1
            result.skipped_kinds.add((vector.data["level"], config["profile"]))
            continue
        if result.replay(vector, partial(run_vector, factory, vector), fail_fast):
            break
    return result
