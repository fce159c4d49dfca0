"""Recording what the pool machine does to a target, so a failure can be replayed.

``run_conformance`` wraps the target factory in a ``Recorder``: every call
the machine makes on the latest target is kept with its outcome, and a
Python exception that is not one of the model's rejections becomes a
``TargetError`` naming the call (a crash, not a divergence).
"""

import json
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolError, PoolState
from kvpool.specs.errors import TargetError
from kvpool.specs.pool.target import EXTENSIONS, PoolTarget, Snapshottable, TargetFactory
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json

QUERIES = ("get_num_free_blocks", "get_usage", "snapshot", "take_reuses")
"""Calls the machine makes after every step to compare; not part of the program
(unless the target parts from the model there). ``take_reuses`` is one: the
machine takes the fired watchers after every step of a target that offers it."""


@dataclass
class Call:
    """One call on the target: operation, Python arguments, and its outcome."""

    op: str
    args: tuple[Any, ...]
    result: Any = None
    error: str | None = None

    def json_args(self) -> dict[str, Json]:
        return protocol.encode_args(self.op, *self.args)

    def outcome(self) -> dict[str, Json]:
        if self.error is not None:
            return {"error": self.error}
        return {"ok": protocol.encode_result(self.op, self.result)}


class Recorder:
    """Wraps a target factory; keeps the calls made on the latest target it built."""

    def __init__(self, make_target: TargetFactory) -> None:
        self.make_target = make_target
        self.config: PoolConfig | None = None
        self.calls: list[Call] = []
        self.inner: PoolTarget | None = None

    def __call__(self, config: PoolConfig) -> PoolTarget:
        self.config = config
        self.calls = []
        self.inner = None
        try:
            self.inner = self.make_target(config)
        except (PoolError, TargetError):
            raise
        except Exception as error:
            raise TargetError(
                crash_message("new_pool", protocol.encode_config(config), error, "target factory")
            ) from error
        if isinstance(self.inner, Snapshottable):
            return SnapshotRecordingTarget(self.inner, self)
        return RecordingTarget(self.inner, self)

    def record(self, op: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        call = Call(op, tuple(list(a) if isinstance(a, list | set) else a for a in args))
        self.calls.append(call)
        try:
            call.result = run()
        except PoolError as error:
            call.error = type(error).__name__
            raise
        except TargetError:
            raise
        except Exception as error:
            call.error = type(error).__name__
            raise TargetError(crash_message(op, call.json_args(), error)) from error
        if isinstance(call.result, list):
            call.result = list(call.result)
        problem = answer_problem(op, call.result)
        if problem is not None:
            call.result = None
            raise TargetError(
                f"target error during {op} {_json_args(call)}: the target answered {problem}"
            )
        return call.result


def answer_problem(op: str, result: Any) -> str | None:
    """Why ``result`` is not an answer to ``op`` the protocol can carry, or None if it is."""
    try:
        value = protocol.encode_result(op, result)
        protocol.check_result(op, value)
        json.dumps(value, allow_nan=False)
    except Exception as error:  # whatever the target returned could not be carried
        return (
            f"{_clipped_repr(result)}, which is not a {op} answer: {type(error).__name__}: {error}"
        )
    ids = op in ("get_new_blocks", "get_cached_block") and result is not None
    if ids and any(isinstance(b, bool) or not isinstance(b, int) for b in result):
        return f"{_clipped_repr(result)}, which holds something other than block ids"
    return None


def _clipped_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as error:  # a target's object whose repr fails
        return f"a {type(value).__name__} whose repr raises {type(error).__name__}"
    return text if len(text) <= 200 else text[:197] + "..."


def _json_args(call: Call) -> str:
    try:
        return json.dumps(call.json_args(), separators=(", ", ": "), default=str)
    except Exception:  # arguments are the kit's own; never fails in practice
        return "(arguments)"


def crash_message(op: str, args: dict[str, Json], error: BaseException, who: str = "target") -> str:
    """What to say when a Python target raises something that is not a rejection."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    shown = json.dumps(args, separators=(", ", ": "), default=str)
    return (
        f"target error during {op} {shown}: the {who} raised {type(error).__name__}: "
        f"{error}{where}. Rejections must be the model's exceptions (kvpool.model.errors)."
    )


class RecordingTarget:
    """A target that tells its recorder about every call (other attributes pass through)."""

    def __init__(self, inner: PoolTarget, recorder: Recorder) -> None:
        self._inner = inner
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._inner, name)
        if name in EXTENSIONS:
            # vLLM 0.33's optional operations: recorded like the others, and
            # absent (AttributeError above) when the target lacks them.
            def recorded(*args: Any) -> Any:
                return self._recorder.record(name, args, lambda: found(*args))

            return recorded
        return found

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        result: Sequence[int] = self._recorder.record(
            "get_new_blocks", (num_blocks,), lambda: self._inner.get_new_blocks(num_blocks)
        )
        return result

    def touch(self, block_ids: Sequence[int]) -> None:
        self._recorder.record("touch", (block_ids,), lambda: self._inner.touch(block_ids))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._recorder.record(
            "free_blocks", (block_ids,), lambda: self._inner.free_blocks(block_ids)
        )

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        args = (
            request,
            block_ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        self._recorder.record(
            "cache_full_blocks", args, lambda: self._inner.cache_full_blocks(*args)
        )

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> HashKey | None:
        flag = (True,) if replace_existing_hashes else ()
        args = (request, block_id, num_tokens, kv_cache_group_id, block_size, *flag)
        key: HashKey | None = self._recorder.record(
            "cache_partial_block", args, lambda: self._inner.cache_partial_block(*args)
        )
        return key

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        args = (block_hash, kv_cache_group_ids)
        result: Sequence[int] | None = self._recorder.record(
            "get_cached_block", args, lambda: self._inner.get_cached_block(*args)
        )
        return result

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = set(block_ids)
        self._recorder.record("evict_blocks", (ids,), lambda: self._inner.evict_blocks(ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self._recorder.record("reset_prefix_cache", (), self._inner.reset_prefix_cache))

    def get_num_free_blocks(self) -> int:
        return int(
            self._recorder.record("get_num_free_blocks", (), self._inner.get_num_free_blocks)
        )

    def get_usage(self) -> float:
        return float(self._recorder.record("get_usage", (), self._inner.get_usage))

    def take_events(self) -> Sequence[KVCacheEvent]:
        events = tuple(self._recorder.record("take_events", (), self._inner.take_events))
        self._recorder.calls[-1].result = events
        return events


class SnapshotRecordingTarget(RecordingTarget):
    """A recording target whose inner target has ``snapshot()``."""

    def snapshot(self) -> PoolState:
        inner = self._inner
        assert isinstance(inner, Snapshottable)
        state: PoolState = self._recorder.record("snapshot", (), inner.snapshot)
        return state
