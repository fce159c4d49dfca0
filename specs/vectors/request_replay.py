"""Replaying the request layer's vectors against a manager target, step by step.

Manager vectors build a manager from their setup and compare every step's
result (and the whole state, where the vector records it and the target has
``snapshot()``). Hash vectors check a hasher alone: they run on a target that
hashes with kvpool's own function (a ``cmd:`` program whose hello says
``"hasher": "kvpool"``, or a factory with a ``hasher``). A target that crashes
is a ``TargetError``, not a mismatch; ``run_request_corpus`` stops at the first.

A vector outside the target's scope (a layout, events, block size or window
it does not claim, a level or profile it does not claim) is skipped.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from kvpool.model import PoolError
from kvpool.model.single_type import AttentionType
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.pool.record import crash_message
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import Json, encode_hash
from kvpool.specs.request.target import ManagerFactory, ManagerSetup, ManagerSnapshottable
from kvpool.specs.vectors.format import LoadedVector
from kvpool.specs.vectors.replay import Mismatch, RunResult
from kvpool.specs.vectors.request_generate import model_block_hashes


class Hasher(Protocol):
    """What hash vectors check: block hashes of a request, and the root hash of a seed."""

    def block_hashes(self, request: Any) -> Sequence[bytes]: ...

    def none_hash(self, seed: str) -> bytes: ...


class ModelHasher:
    """The model's own hasher (``kvpool.model.hashing``), as hash vectors see it."""

    def block_hashes(self, request: Any) -> Sequence[bytes]:
        return model_block_hashes(request)

    def none_hash(self, seed: str) -> bytes:
        from kvpool.model.hashing import none_hash

        return none_hash(seed)


# --------------------------------------------------------------------------
# Scope
# --------------------------------------------------------------------------


def layout_of(setup: ManagerSetup) -> str:
    """The layout name of a setup's groups (``full+sliding_window``, ...); a group of
    larger blocks than the others is ``wide_`` (``wide_full+sliding_window``)."""
    names = {
        AttentionType.FULL: "full",
        AttentionType.SLIDING_WINDOW: "sliding_window",
        AttentionType.CHUNKED_LOCAL: "chunked_local",
        AttentionType.MAMBA: "mamba",
    }
    if any(s.attention is AttentionType.MAMBA for s in setup.specs):
        return "+".join(names[s.attention] for s in setup.specs)
    narrowest = min(s.block_size for s in setup.specs)
    return "+".join(
        ("wide_" if s.block_size > narrowest else "") + names[s.attention] for s in setup.specs
    )


def in_scope(setup: ManagerSetup, scope: Mapping[str, Any]) -> bool:
    """Whether a vector's setup lies in the part of the space a target claims."""
    layout = layout_of(setup)
    if "layouts" in scope and layout not in scope["layouts"]:
        return False
    if "events" in scope and setup.enable_events not in scope["events"]:
        return False
    # the narrowest group's blocks, as the manager holds them, in hash blocks
    sizes = [s.block_size * (setup.dcp_world_size if s.dcp_sharded else 1) for s in setup.specs]
    factors = {min(sizes) // setup.hash_block_size}
    cp = [setup.dcp_world_size, setup.pcp_world_size]
    if cp != [1, 1] and cp not in [list(c) for c in scope.get("context_parallel", [])]:
        return False
    if "block_factors" in scope and not factors <= set(scope["block_factors"]):
        return False
    if setup.enable_caching and layout in scope.get("uncached_layouts", ()):
        return False
    if setup.num_prefill_lookahead not in (0, *scope.get("prefill_lookaheads", ())):
        return False
    # groups flagged as EAGLE's (vLLM 0.33's is_eagle_group) only where the target claims them
    if setup.eagle_groups and not scope.get("eagle_flags", False):
        return False
    if setup.enable_caching and layout in scope.get("hash_sized_layouts", ()) and factors != {1}:
        return False
    windows = [s.sliding_window for s in setup.specs if s.attention is AttentionType.SLIDING_WINDOW]
    return not windows or min(windows) >= int(scope.get("min_window", 1))


# --------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------


def same_result(op: str, expected: Json, actual: Json) -> bool:
    """Whether a target's JSON result counts as the model's.

    Usage within 1e-9; a common-prefix answer of null means the target does
    not support the query (it is not compared).
    """
    if op == "usage":
        return (
            isinstance(actual, int | float)
            and not isinstance(actual, bool)
            and math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-9)
        )
    if op == "get_num_common_prefix_blocks" and actual is None:
        return True
    return bool(expected == actual)


def check_manager_step(target: Any, step: Mapping[str, Json]) -> str | None:
    """Run one step on ``target``; None if it matches, else what went wrong."""
    op, args, expect = step["op"], step["args"], step["expect"]
    try:
        actual = codec.apply(target, op, args)
    except PoolError as rejection:
        name = type(rejection).__name__
        if "error" not in expect:
            return (
                f"the model accepts it (returning {expect['ok']!r}), "
                f"the target rejects it with {name}: {rejection}"
            )
        if name != expect["error"]:
            return f"the model rejects it with {expect['error']}, the target with {name}"
        return None
    if "error" in expect:
        return (
            f"the model rejects it with {expect['error']}, "
            f"the target accepts it (returning {actual!r})"
        )
    if not same_result(op, expect["ok"], actual):
        return f"the model returns {expect['ok']!r}, the target returned {actual!r}"
    return None


def state_problem(target: Any, expected: Json) -> str | None:
    """What differs if the target's state (with ``snapshot()``) is not ``expected``."""
    if not isinstance(target, ManagerSnapshottable):
        return None
    actual = codec.encode_manager_state(target.snapshot())
    if actual == expected:
        return None
    parts = [
        name
        for name in ("pool", "groups", "stats")
        if actual.get(name) != (expected or {}).get(name)
    ]
    return f"the target's state differs from the model's in {', '.join(parts)}"


def check_hash_step(hasher: Hasher, step: Mapping[str, Json]) -> str | None:
    """Run one hasher step; None if it matches, else what went wrong."""
    op, args, expect = step["op"], step["args"], step["expect"]
    try:
        if op == "none_hash":
            actual: Json = encode_hash(hasher.none_hash(str(args["seed"])))
        else:
            request = codec.decode_request(args["request"])
            actual = [encode_hash(bytes(h)) for h in hasher.block_hashes(request)]
    except PoolError as rejection:
        name = type(rejection).__name__
        if "error" not in expect:
            return f"the model hashes it, the target rejects it with {name}: {rejection}"
        if name != expect["error"]:
            return f"the model rejects it with {expect['error']}, the target with {name}"
        return None
    if "error" in expect:
        return f"the model rejects it with {expect['error']}, the target hashes it"
    if actual != expect["ok"]:
        return f"the model's hashes are {expect['ok']!r}, the target's {actual!r}"
    return None


# --------------------------------------------------------------------------
# Vectors and corpora
# --------------------------------------------------------------------------


def run_manager_vector(factory: ManagerFactory, vector: LoadedVector) -> Mismatch | None:
    """Replay one manager vector; None if the target matches it at every step."""
    data = vector.data
    setup = codec.decode_setup(data["setup"])
    vid = str(data["id"])
    try:
        target = factory(setup)
    except PoolError as error:
        return Mismatch(
            vid,
            vector.where,
            0,
            "new_manager",
            data["setup"],
            f"the target cannot build the manager: {type(error).__name__}: {error}",
        )
    except (TargetError, TargetAbort):
        raise
    except Exception as error:  # the target's own bug: a target error, not a kit crash
        raise TargetError(crash_message("new_manager", data["setup"], error)) from error
    for number, step in enumerate(data["steps"], 1):
        try:
            problem = check_manager_step(target, step)
            if problem is None and "state" in step:
                problem = state_problem(target, step["state"])
        except (TargetError, TargetAbort):
            raise
        except Exception as error:  # the target's own bug: a target error, not a kit crash
            raise TargetError(crash_message(step["op"], step["args"], error)) from error
        if problem is not None:
            return Mismatch(vid, vector.where, number, step["op"], step["args"], problem)
    return None


def run_hash_vector(hasher: Hasher, vector: LoadedVector) -> Mismatch | None:
    """Replay one hash vector on a hasher."""
    data = vector.data
    for number, step in enumerate(data["steps"], 1):
        try:
            problem = check_hash_step(hasher, step)
        except (TargetError, TargetAbort):
            raise
        except Exception as error:  # the target's own bug: a target error, not a kit crash
            raise TargetError(crash_message(step["op"], step["args"], error)) from error
        if problem is not None:
            vid = str(data["id"])
            return Mismatch(vid, vector.where, number, step["op"], step["args"], problem)
    return None


@dataclass
class RequestRunResult(RunResult):
    """The outcome of replaying a request-layer corpus."""

    skipped_why: dict[str, int] = field(default_factory=dict)


def run_request_corpus(
    factory: ManagerFactory,
    vectors: Sequence[LoadedVector],
    levels: Sequence[int] | None = None,
    profiles: Sequence[str] | None = None,
    scope: Mapping[str, Any] | None = None,
    hasher: Hasher | None = None,
    fail_fast: bool = False,
) -> RequestRunResult:
    """Replay every vector in the chosen levels, profiles and scope; count what happened."""
    result = RequestRunResult()

    def skip(why: str) -> None:
        result.skipped += 1
        result.skipped_why[why] = result.skipped_why.get(why, 0) + 1

    for vector in vectors:
        data = vector.data
        if levels is not None and data["level"] not in levels:
            skip("a level the target does not claim")
            continue
        if data["kind"] == "hash":
            if hasher is None:
                skip("hash vectors: the target does not hash with kvpool's function")
                continue
        else:
            setup = codec.decode_setup(data["setup"])
            if profiles is not None and setup.profile.name not in profiles:
                skip("a profile the target does not claim")
                continue
            if scope is not None and not in_scope(setup, scope):
                skip("outside the target's scope")
                continue
        if data["kind"] == "hash":
            assert hasher is not None
            stop = result.replay(vector, partial(run_hash_vector, hasher, vector), fail_fast)
        else:
            stop = result.replay(vector, partial(run_manager_vector, factory, vector), fail_fast)
        if stop:
            break
    return result
