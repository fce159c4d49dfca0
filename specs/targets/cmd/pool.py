"""``cmd:PROGRAM ARGS``: a pool in any language, spoken to over JSON lines.

The kit starts the program once per run and keeps it (a ``Session``,
``kvpool.specs.targets.cmd.session``): every test case begins with a
``new_pool`` request, which replaces the program's pool, so a run of
thousands of programs does not pay for thousands of process starts. The
exchange is described in docs/formats.md and ``kvpool.specs.protocol.codec``;
this module adds what is the pool's: its hello (levels, profiles, snapshot),
its rejections (``kvpool.model.errors``) and the shape of each result.

Every request waits at most ``timeout`` seconds for its answer (default 5,
or the ``KVPOOL_CMD_TIMEOUT`` environment variable). A program that crashes,
hangs, prints something that is not a JSON answer, or answers out of turn
raises ``TargetError`` naming the operation, what happened, the exit code
and the last lines of its stderr (the session module says more). The
program runs in a process group of its own, ended as a whole.

POSIX only.
"""

from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from kvpool import model
from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolError, PoolState
from kvpool.model.profiles import profile_named
from kvpool.specs.pool.target import EXTENSIONS, OPT_IN_FEATURES
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json, ProtocolError
from kvpool.specs.targets.cmd.session import (
    DEFAULT_TIMEOUT,
    TIMEOUT_ENV,
    Dialect,
    Session,
    SessionFailure,
    default_timeout,
    show_args,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "POOL_DIALECT",
    "TIMEOUT_ENV",
    "CmdTarget",
    "CmdTargetFactory",
    "SnapshotCmdTarget",
    "default_timeout",
]

_CHECKS = ("get_num_free_blocks", "get_usage", "snapshot")
"""Requests the kit makes to compare after each step: not listed as the program's operations."""


def _check_hello(hello: dict[str, Json]) -> dict[str, Json]:
    levels, profiles = hello.get("levels", [1]), hello.get("profiles", [])
    if (
        not isinstance(levels, list)
        or not levels
        or not all(x in (1, 2) and not isinstance(x, bool) for x in levels)
    ):
        raise SessionFailure(f"hello: levels must be a list of 1 and/or 2, got {levels!r:.200}")
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise SessionFailure(
            f"hello: profiles must be a list of profile names, got {profiles!r:.200}"
        )
    unknown = [p for p in profiles if not _known_profile(p)]
    if unknown:
        raise SessionFailure(
            f"hello: unknown profile(s) {unknown!r:.200}; the profiles are "
            f"{', '.join(model.PROFILES)}"
        )
    if not isinstance(hello.get("snapshot", False), bool):
        raise SessionFailure(
            f"hello: snapshot must be true or false, got {hello['snapshot']!r:.100}"
        )
    return hello


def _known_profile(name: str) -> bool:
    try:
        profile_named(name)
    except model.InvalidConfig:
        return False
    return True


POOL_DIALECT = Dialect(
    version=protocol.PROTOCOL_VERSION,
    check_hello=_check_hello,
    is_rejection=lambda name: protocol.error_class(name) is not None,
    check_result=protocol.check_result,
    unchecked=frozenset({"hello", "new_pool"}),
    queries=frozenset(_CHECKS),
)
"""The pool layer's protocol (docs/formats.md) as a session dialect."""


class CmdTargetFactory:
    """Builds targets backed by one program; ``resolve_target("cmd:...")`` returns one.

    >>> factory = CmdTargetFactory.from_spec("cmd:python3 -m kvpool.specs.protocol.codec model")
    >>> factory.argv
    ['python3', '-m', 'kvpool.specs.protocol.codec', 'model']
    """

    def __init__(
        self, argv: Sequence[str], timeout: float | None = None, cwd: str | None = None
    ) -> None:
        self.session = Session(argv, POOL_DIALECT, timeout, cwd)
        self.generation = 0

    @classmethod
    def from_spec(cls, spec: str, timeout: float | None = None) -> "CmdTargetFactory":
        """The factory for a ``cmd:PROGRAM ARGS`` target string (split like a shell).

        ValueError if the string names no program or KVPOOL_CMD_TIMEOUT is unusable.
        """
        import shlex

        _, _, command = spec.partition(":")
        return cls(shlex.split(command), timeout)

    @property
    def argv(self) -> list[str]:
        return self.session.argv

    @property
    def timeout(self) -> float:
        return self.session.timeout

    @property
    def command(self) -> str:
        return self.session.command

    # What the target says it supports -------------------------------------------

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(self.session.hello_answer().get("levels") or (1,))

    @property
    def profiles(self) -> tuple[str, ...]:
        hello = self.session.hello_answer()
        return tuple(hello.get("profiles") or (model.DEFAULT_PROFILE.name,))

    @property
    def has_snapshot(self) -> bool:
        return bool(self.session.hello_answer().get("snapshot", False))

    def unsupported_operations(self) -> frozenset[str]:
        """vLLM 0.33's operations and features: the protocol does not carry them yet."""
        return frozenset((*EXTENSIONS, *OPT_IN_FEATURES))

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
        self.session.recent.clear()
        self.session.last = None
        try:
            self.request("new_pool", protocol.encode_config(config))
        except PoolError as rejection:
            try:
                model.new_pool(config.num_blocks, hash_block_size=config.hash_block_size)
            except PoolError:
                raise rejection from None
            self._fail_now(
                f"the target rejected new_pool {show_args(protocol.encode_config(config))} with "
                f"{type(rejection).__name__}, but the configuration is valid"
            )
        cls = SnapshotCmdTarget if self.has_snapshot else CmdTarget
        return cls(self, config, self.generation)

    def close(self) -> None:
        """Stop the program and its process group (closing its stdin first)."""
        self.session.close()

    # The exchange -------------------------------------------------------------

    def request(self, op: str, args: dict[str, Json]) -> Json:
        """Send one request; return the ``ok`` value or raise the named PoolError.

        Raises TargetError when the program misbehaves (and from then on).
        """
        reply = self.session.request(op, args)
        if "error" in reply:
            raise _rejection(reply)
        return reply["ok"]

    def _fail_now(self, message: str) -> NoReturn:
        self.session.fail_now(message)


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


def _rejection(reply: dict[str, Json]) -> PoolError:
    cls = protocol.error_class(reply["error"])
    assert cls is not None
    message = reply.get("message")
    return cls(message if isinstance(message, str) else "rejected by the target")
