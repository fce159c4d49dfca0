"""Recording what the request-level machine does to a manager target, so a failure can be replayed.

``run_request_conformance`` wraps the target factory in a ``ManagerRecorder``:
every call the machine makes on the latest target is kept with its outcome
(``kvpool.specs.request.counterexample`` replays them on the model when the
run fails). A factory that cannot build a target (it raises, or rejects a
setup the model accepts) is a ``TargetError`` naming the setup: the target
cannot be checked, which is not a divergence.
"""

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import currently_in_test_context

from kvpool.model import PoolError
from kvpool.model import manager as model_manager
from kvpool.model.events import KVCacheEvent
from kvpool.model.manager import Blocks, KVCacheManagerState, PrefixCacheStats
from kvpool.model.request import Request
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.request.target import (
    OPERATIONS_033,
    OPERATIONS_SCHEDULER,
    ManagerFactory,
    ManagerSetup,
    ManagerSnapshottable,
    ManagerTarget,
    geometry_arguments,
    retention_arguments,
)

QUERIES = ("get_block_ids", "usage", "num_free_blocks", "snapshot", "block_hashes")
"""What the machine asks after steps to compare and check: not part of the program."""


@dataclass
class ManagerCall:
    """One call on the target: operation, Python arguments, and its outcome."""

    op: str
    args: tuple[Any, ...]
    result: Any = None
    error: str | None = None

    def json_args(self) -> dict[str, Json]:
        return codec.encode_args(self.op, *self.args)

    def outcome(self) -> dict[str, Json]:
        if self.error is not None:
            return {"error": self.error}
        try:
            return {"ok": codec.encode_result(self.op, self.result)}
        except (TypeError, ValueError, AttributeError):
            return {"ok": repr(self.result)}


class ManagerRecorder:
    """Wraps a manager factory; keeps the calls made on the latest target it built."""

    def __init__(self, make_target: ManagerFactory) -> None:
        self.make_target = make_target
        self.setup: ManagerSetup | None = None
        self.calls: list[ManagerCall] = []
        self.inner: ManagerTarget | None = None

    def __getattr__(self, name: str) -> Any:
        # preflight, declared_scope, levels, close ...: the factory's own.
        return getattr(self.make_target, name)

    def __call__(self, setup: ManagerSetup) -> ManagerTarget:
        self.setup = setup
        self.calls = []
        self.inner = None
        self.inner = build(self.make_target, setup)
        return recording(self.inner, self)

    def record(self, op: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        call = ManagerCall(op, args)
        self.calls.append(call)
        try:
            call.result = run()
        except TargetError:
            raise
        except Exception as error:
            call.error = type(error).__name__
            raise
        return call.result


def build(make_target: ManagerFactory, setup: ManagerSetup) -> ManagerTarget:
    """``make_target(setup)``; TargetError (TargetAbort in a test) if it cannot build it."""
    try:
        return make_target(setup)
    except (TargetError, TargetAbort):
        raise
    except PoolError as rejection:
        try:
            _model_manager(setup)
        except PoolError:
            raise rejection from None
        message = (
            f"the target rejected the setup {_show(codec.encode_setup(setup))} with "
            f"{type(rejection).__name__} ({rejection}), but the model accepts it"
        )
    except Exception as error:
        message = (
            f"the factory could not build a target for {_show(codec.encode_setup(setup))}: "
            f"it raised {type(error).__name__}: {error}"
        )
    failure = TargetError(message)
    if currently_in_test_context():
        raise TargetAbort(failure)
    raise failure


def _model_manager(setup: ManagerSetup) -> KVCacheManagerState:
    return model_manager.new_kv_cache_manager(
        setup.num_blocks,
        setup.specs,
        setup.max_model_len,
        hash_block_size=setup.hash_block_size,
        enable_caching=setup.enable_caching,
        use_eagle=setup.use_eagle,
        log_stats=setup.log_stats,
        enable_events=setup.enable_events,
        profile=setup.profile,
        fine_grained_hits=setup.fine_grained_hits,
        max_in_flight_tokens=setup.max_in_flight_tokens,
        num_prefill_lookahead=setup.num_prefill_lookahead,
        **geometry_arguments(setup),
        **retention_arguments(setup),
        eagle_groups=setup.eagle_groups,
    )


def _show(value: Json) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= 300 else text[:297] + "..."


class RecordingManager:
    """A manager target that tells its recorder about every call (other attributes pass through)."""

    def __init__(self, inner: ManagerTarget, recorder: ManagerRecorder) -> None:
        self._inner = inner
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if (name in OPERATIONS_033 or name in OPERATIONS_SCHEDULER) and callable(value):
            # vLLM 0.33's further calls, recorded only on a target that has them
            return lambda *args: self._recorder.record(name, args, lambda: value(*args))
        return value

    def _record(self, op: str, *args: Any) -> Any:
        method = getattr(self._inner, op)
        return self._recorder.record(op, args, lambda: method(*args))

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int]:
        result: tuple[Blocks, int] = self._record("get_computed_blocks", request)
        return result

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        reserved_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> Blocks | None:
        # the flag is passed (and recorded) only when set: a target without the scheduler
        # calls is never asked for it; so are a KV connector's arguments after it
        whole: tuple[Any, ...] = (True,) if full_sequence_must_fit else ()
        connector = (num_external_computed_tokens, reserved_blocks, tuple(skip_zeroing_group_ids))
        if connector != (0, 0, ()):
            whole = (full_sequence_must_fit, *connector)
        result: Blocks | None = self._record(
            "allocate_slots",
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            delay_cache_blocks,
            *whole,
        )
        return result

    def free(self, request: Request) -> None:
        self._record("free", request)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._record("cache_blocks", request, num_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._record("evict_blocks", set(block_ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self._record("reset_prefix_cache"))

    def get_num_common_prefix_blocks(self, request_id: str) -> Sequence[int] | None:
        result: Sequence[int] | None = self._record("get_num_common_prefix_blocks", request_id)
        return result

    def get_block_ids(self, request_id: str) -> Blocks:
        result: Blocks = self._record("get_block_ids", request_id)
        return result

    def take_events(self) -> Sequence[KVCacheEvent]:
        events = tuple(self._record("take_events"))
        self._recorder.calls[-1].result = events
        return events

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        result: PrefixCacheStats | None = self._record("make_prefix_cache_stats")
        return result

    def usage(self) -> float:
        return float(self._record("usage"))

    def num_free_blocks(self) -> int:
        return int(self._record("num_free_blocks"))


class _Snapshot:
    def snapshot(self) -> KVCacheManagerState:
        recording: Any = self
        state: KVCacheManagerState = recording._record("snapshot")
        return state


class _Hasher:
    def block_hashes(self, request: Request) -> Sequence[bytes]:
        recording: Any = self
        hashes: Sequence[bytes] = recording._record("block_hashes", request)
        return hashes


class _SnapshotRecordingManager(_Snapshot, RecordingManager):
    pass


class _HasherRecordingManager(_Hasher, RecordingManager):
    pass


class _SnapshotHasherRecordingManager(_Snapshot, _Hasher, RecordingManager):
    pass


def recording(inner: ManagerTarget, recorder: ManagerRecorder) -> ManagerTarget:
    """``inner`` behind a recording wrapper with the same optional methods (snapshot, hasher)."""
    snapshot = isinstance(inner, ManagerSnapshottable)
    hasher = callable(getattr(inner, "block_hashes", None))
    cls: type[RecordingManager] = RecordingManager
    if snapshot and hasher:
        cls = _SnapshotHasherRecordingManager
    elif snapshot:
        cls = _SnapshotRecordingManager
    elif hasher:
        cls = _HasherRecordingManager
    target: Any = cls(inner, recorder)
    return target  # type: ignore[no-any-return]
