"""``cmd:PROGRAM ARGS``: a pool in any language, spoken to over JSON lines.

The kit starts the program once per run and keeps it: every test case
begins with a ``new_pool`` request, which replaces the program's pool, so a
run of thousands of programs does not pay for thousands of process starts.
The exchange is described in docs/formats.md and ``kvpool.specs.protocol.codec``.

Every request waits at most ``timeout`` seconds for its answer (default 5,
or the ``KVPOOL_CMD_TIMEOUT`` environment variable). A program that crashes,
hangs, prints something that is not a JSON answer, or answers out of turn
raises ``TargetError`` naming the operation, what happened, the exit code
and the last lines of its stderr. From then on the target is *broken*:
every further call raises the same error at once. Inside a Hypothesis test
the error travels as ``TargetAbort`` (a ``BaseException`` carrying it), so
that Hypothesis does not try to replay and shrink a program on a target that
cannot be replayed; ``run_conformance`` turns it back into the TargetError.

POSIX only (it waits on the program's stdout with ``select``).
"""

import json
import shlex
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from hypothesis import currently_in_test_context

from kvpool import model
from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolError, PoolState
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.targets.cmd.process import (
    DEFAULT_TIMEOUT,
    MAX_LINE,
    STDERR_LINES,
    TIMEOUT_ENV,
    default_timeout,
)
from kvpool.specs.targets.cmd.process import Failure as _Failure
from kvpool.specs.targets.cmd.process import Process as _Process
from kvpool.specs.targets.cmd.process import clip as _clip
from kvpool.specs.targets.cmd.process import reply_problem as _reply_problem
from kvpool.specs.targets.cmd.process import show as _show
from kvpool.specs.targets.cmd.process import signal_name as _signal_name

__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_LINE",
    "STDERR_LINES",
    "TIMEOUT_ENV",
    "CmdTarget",
    "CmdTargetFactory",
    "SnapshotCmdTarget",
    "default_timeout",
]

RECENT_REQUESTS = 12
_CHECKS = ("get_num_free_blocks", "get_usage", "snapshot")
"""Requests the kit makes to compare after each step: not listed as the program's operations."""


class CmdTargetFactory:
    """Builds targets backed by one program; ``resolve_target("cmd:...")`` returns one.

    >>> factory = CmdTargetFactory.from_spec("cmd:python3 -m kvpool.specs.protocol.codec model")
    >>> factory.argv
    ['python3', '-m', 'kvpool.specs.protocol.codec', 'model']
    """

    def __init__(
        self, argv: Sequence[str], timeout: float | None = None, cwd: str | None = None
    ) -> None:
        if not argv:
            raise ValueError("cmd: needs a program to run")
        self.argv = list(argv)
        self.timeout = default_timeout() if timeout is None else timeout
        self.cwd = cwd
        self.process: _Process | None = None
        self.hello: dict[str, Json] | None = None
        self.broken: str | None = None
        self.generation = 0
        self.next_id = 0
        self.recent: deque[str] = deque(maxlen=RECENT_REQUESTS)
        self.last: tuple[str, str] | None = None

    @classmethod
    def from_spec(cls, spec: str, timeout: float | None = None) -> "CmdTargetFactory":
        """The factory for a ``cmd:PROGRAM ARGS`` target string (split like a shell)."""
        _, _, command = spec.partition(":")
        return cls(shlex.split(command), timeout)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    # What the target says it supports -------------------------------------------

    @property
    def levels(self) -> tuple[int, ...]:
        hello = self._hello()
        return tuple(hello.get("levels") or (1,))

    @property
    def profiles(self) -> tuple[str, ...]:
        hello = self._hello()
        return tuple(hello.get("profiles") or (model.DEFAULT_PROFILE.name,))

    @property
    def has_snapshot(self) -> bool:
        return bool(self._hello().get("snapshot", False))

    def preflight(self, level: int, profiles: Sequence[str]) -> None:
        """Start the program; raise TargetError if it cannot run ``level`` and ``profiles``."""
        missing = [p for p in profiles if p not in self.profiles]
        if level not in self.levels:
            self._fail_now(
                f"the target does not support level {level}: its hello lists levels "
                f"{list(self.levels)}"
            )
        if missing:
            self._fail_now(
                f"the target does not implement profile(s) {missing}: its hello lists "
                f"{list(self.profiles)}"
            )

    # Building targets ---------------------------------------------------------

    def __call__(self, config: PoolConfig) -> "CmdTarget":
        if config.profile.name not in self.profiles:
            self._fail_now(
                f"new_pool asks for profile {config.profile.name!r}, which the target does not "
                f"implement (its hello lists {list(self.profiles)})"
            )
        self.generation += 1
        self.recent.clear()
        self.last = None
        try:
            self.request("new_pool", protocol.encode_config(config))
        except PoolError as rejection:
            try:
                model.new_pool(config.num_blocks, hash_block_size=config.hash_block_size)
            except PoolError:
                raise rejection from None
            self._fail_now(
                f"the target rejected new_pool {_show(protocol.encode_config(config))} with "
                f"{type(rejection).__name__}, but the configuration is valid"
            )
        cls = SnapshotCmdTarget if self.has_snapshot else CmdTarget
        return cls(self, config, self.generation)

    def close(self) -> None:
        """Stop the program (closing its stdin first, so it can exit on its own)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    # The exchange -------------------------------------------------------------

    def request(self, op: str, args: dict[str, Json]) -> Json:
        """Send one request; return the ``ok`` value or raise the named PoolError.

        Raises TargetError when the program misbehaves (and from then on).
        """
        reply: dict[str, Json] | None = None
        if self.broken is None:
            try:
                reply = self._exchange(op, args)
            except _Failure as failure:
                self.broken = str(failure)
        if reply is None:
            self._raise_broken()
        if "error" in reply:
            raise _rejection(reply)
        return reply["ok"]

    def _raise_broken(self) -> NoReturn:
        error = TargetError(self.broken or "the target is broken")
        if currently_in_test_context():
            raise TargetAbort(error)
        raise error

    def _fail_now(self, message: str) -> NoReturn:
        if self.broken is None:
            self.broken = message
            self.close()
        self._raise_broken()

    def _hello(self) -> dict[str, Json]:
        if self.hello is None:
            self._ensure_started()
        if self.hello is None:
            self._raise_broken()
        return self.hello

    def _ensure_started(self) -> None:
        if self.process is not None or self.broken is not None:
            return
        try:
            self.process = _Process(self.argv, self.cwd)
            reply = self._exchange(
                "hello", {"protocol": protocol.PROTOCOL_VERSION, "kit": "kvpool"}, starting=True
            )
            self.hello = _check_hello(reply)
        except _Failure as failure:
            self.broken = str(failure)
            self.close()

    def _exchange(self, op: str, args: dict[str, Json], starting: bool = False) -> dict[str, Json]:
        if not starting:
            self._ensure_started()
            if self.broken is not None:
                raise _Failure(self.broken)
        process = self.process
        assert process is not None
        request_id = self.next_id
        self.next_id += 1
        line = json.dumps({"id": request_id, "op": op, "args": args}, separators=(",", ":"))
        what = f"{op} {_show(args)}" if args else op
        if self.last is not None and self.last[0] not in _CHECKS:
            self.recent.append(self.last[1])
        self.last = (op, what)
        try:
            process.send(line.encode() + b"\n")
            raw = process.receive(self.timeout)
        except TimeoutError:
            raise _Failure(
                self._report(
                    process,
                    what,
                    f"the target did not answer within {self.timeout:g} s "
                    f"(it hangs?); it was stopped",
                    alive=True,
                )
            ) from None
        except OSError as error:
            raise _Failure(
                self._report(process, what, f"the target stopped reading its input ({error})")
            ) from None
        if raw is None:
            raise _Failure(self._report(process, what, "the target closed its output (crashed?)"))
        try:
            reply = json.loads(raw)
        except ValueError:
            raise _Failure(
                self._report(
                    process,
                    what,
                    f"the target printed something that is not JSON: {_clip(raw)}",
                    alive=True,
                )
            ) from None
        problem = _reply_problem(reply, request_id)
        if problem is not None:
            raise _Failure(self._report(process, what, problem, alive=True))
        assert isinstance(reply, dict)
        if "error" in reply:
            name = reply["error"]
            if name == "ProtocolError":
                raise _Failure(
                    self._report(
                        process,
                        what,
                        f"the target could not read the request: {reply.get('message')}",
                        alive=True,
                    )
                )
            if protocol.error_class(name) is None:
                raise _Failure(
                    self._report(
                        process,
                        what,
                        f"the target answered with error {name!r}, which is not an exception "
                        f"of kvpool.model.errors (message: {reply.get('message')!r})",
                        alive=True,
                    )
                )
        elif op not in ("hello", "new_pool"):
            try:
                protocol.check_result(op, reply["ok"])
            except ProtocolError as error:
                raise _Failure(
                    self._report(process, what, f"malformed result: {error}", alive=True)
                ) from None
        return reply

    def _report(self, process: _Process, what: str, problem: str, alive: bool = False) -> str:
        lines = [f"target error during {what}: {problem}."]
        if alive:
            process.popen.kill()
        code = process.exit_code(2.0)
        if not alive and code is not None:
            lines.append(f"exit code: {code}{_signal_name(code)}")
        tail = process.stderr_tail()
        if tail:
            lines.append("last lines of its stderr:")
            lines.extend(f"  {t}" for t in tail)
        else:
            lines.append("its stderr is empty.")
        earlier = list(self.recent)
        if earlier:
            lines.append("operations before it in this test case (oldest first):")
            lines.extend(f"  {r}" for r in earlier)
        lines.append(f"command: {self.command}")
        self.close()
        return "\n".join(lines)


class CmdTarget:
    """One test case's pool inside the program (valid until the next ``new_pool``)."""

    def __init__(self, factory: CmdTargetFactory, config: PoolConfig, generation: int) -> None:
        self.factory = factory
        self.config = config
        self.generation = generation

    def _call(self, op: str, *args: Any) -> Any:
        if self.generation != self.factory.generation:
            raise RuntimeError("this target was replaced by a later new_pool")
        value = self.factory.request(op, protocol.encode_args(op, *args))
        return protocol.decode_result(op, value)

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        result: Sequence[int] = self._call("get_new_blocks", num_blocks)
        return result

    def touch(self, block_ids: Sequence[int]) -> None:
        self._call("touch", block_ids)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._call("free_blocks", block_ids)

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
        self._call(
            "cache_full_blocks",
            request,
            block_ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None:
        key: HashKey | None = self._call(
            "cache_partial_block", request, block_id, num_tokens, kv_cache_group_id, block_size
        )
        return key

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        result: Sequence[int] | None = self._call(
            "get_cached_block", block_hash, kv_cache_group_ids
        )
        return result

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._call("evict_blocks", block_ids)

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def get_num_free_blocks(self) -> int:
        return int(self._call("get_num_free_blocks"))

    def get_usage(self) -> float:
        return float(self._call("get_usage"))

    def take_events(self) -> Sequence[KVCacheEvent]:
        events: Sequence[KVCacheEvent] = self._call("take_events")
        return events


class SnapshotCmdTarget(CmdTarget):
    """A program whose hello says ``"snapshot": true``: the whole state is compared."""

    def snapshot(self) -> PoolState:
        value = self._call("snapshot")
        try:
            return protocol.decode_state(value, self.config)
        except ProtocolError as error:
            message = f"target error during snapshot: malformed state: {error}"
        self.factory._fail_now(message)


def _check_hello(reply: dict[str, Json]) -> dict[str, Json]:
    if "error" in reply:
        raise _Failure(f"the target refused hello: {reply.get('error')} {reply.get('message')}")
    hello = reply.get("ok")
    if not isinstance(hello, dict):
        raise _Failure(f"the target answered hello with {hello!r}, not an object")
    version = hello.get("protocol")
    if version != protocol.PROTOCOL_VERSION:
        raise _Failure(
            f"the target speaks protocol version {version!r}; this kit speaks "
            f"{protocol.PROTOCOL_VERSION}"
        )
    levels, profiles = hello.get("levels", [1]), hello.get("profiles", [])
    if not isinstance(levels, list) or not all(x in (1, 2) for x in levels):
        raise _Failure(f"hello: levels must be a list of 1 and/or 2, got {levels!r}")
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise _Failure(f"hello: profiles must be a list of profile names, got {profiles!r}")
    return hello


def _rejection(reply: dict[str, Json]) -> PoolError:
    cls = protocol.error_class(reply["error"])
    assert cls is not None
    message = reply.get("message")
    return cls(message if isinstance(message, str) else "rejected by the target")
