"""Where a run keeps the failing programs it found: kvpool's own example database.

Hypothesis saves every failing program and replays it first the next time
(its ``reuse`` phase). Left to itself it keeps them in ``.hypothesis/`` under
the working directory, keyed by the test, which for kvpool is the same for
every target: a check run from a directory that held another target's
failure replayed that failure first. kvpool therefore gives every target at
every layer its own directory under its own location::

    $KVPOOL_HYPOTHESIS_DIR, else $XDG_CACHE_HOME/kvpool/examples, else ~/.cache/kvpool/examples
        └── pool/impl-3f2a9c1e0b7d/        one directory per layer and target string

A run with a seed uses no database at all (it replays nothing the seed did
not produce, and saves nothing); the ``ci`` and ``mutation`` profiles use
none either.

Workers sharing failures (docs/fuzzing.md) also read and write one Redis
server, named by ``KVPOOL_REDIS_URL``; its keys carry the layer and target
too. Redis is checked (``check_redis``) before a run, never when kvpool is
merely imported: a Redis that cannot be used is one line in the report and
the run uses the local directory alone, unless the run asked for Redis
(``DatabaseChoice.REDIS``), which then stops with exit 2 before running. A
Redis that fails during the run is dropped the same way. Needs the ``redis``
client (``pip install 'kvpool[fuzz]'``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
)

REDIS_URL_VARIABLE = "KVPOOL_REDIS_URL"
LOCAL_VARIABLE = "KVPOOL_HYPOTHESIS_DIR"
REDIS_TIMEOUT = 2.0
"""Seconds to wait for Redis to connect or answer before it counts as unusable."""


class DatabaseChoice(StrEnum):
    """Which example database a run uses (``kvpool check --database``)."""

    AUTO = "auto"
    """kvpool's local directory, and Redis too when KVPOOL_REDIS_URL names a usable one."""
    LOCAL = "local"
    """kvpool's local directory only."""
    REDIS = "redis"
    """The local directory and Redis; a Redis that cannot be used stops the run (exit 2)."""
    NONE = "none"
    """No database: nothing replayed, nothing saved."""


_chosen = DatabaseChoice.AUTO


def choose(choice: DatabaseChoice) -> None:
    """Set the database every later run in this process uses (``kvpool check --database``)."""
    global _chosen
    _chosen = choice


def chosen() -> DatabaseChoice:
    """The database choice runs use (``choose``; AUTO unless set)."""
    return _chosen


class RedisUnavailable(Exception):
    """KVPOOL_REDIS_URL names no Redis this process can use; the message is one line."""


def examples_home() -> Path:
    """The directory under which every layer and target has its own example directory."""
    chosen = os.environ.get(LOCAL_VARIABLE)
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvpool" / "examples"


def target_key(layer: str, target: str) -> str:
    """``layer/name-hash``: a directory name (and Redis key part) for one target at one layer.

    >>> target_key("pool", "cmd:./my pool --fast")
    'pool/cmd-my-pool-fast-e2c7b9f95df8'
    """
    name = re.sub(r"[^A-Za-z0-9_]+", "-", target).strip("-")[:40] or "target"
    digest = hashlib.sha256(f"{layer}\0{target}".encode()).hexdigest()[:12]
    return f"{layer}/{name}-{digest}"


def local_database(layer: str, target: str) -> ExampleDatabase:
    """The directory database of ``target`` at ``layer`` (created when first written)."""
    return DirectoryBasedExampleDatabase(str(examples_home() / target_key(layer, target)))


def redis_url() -> str | None:
    """The Redis URL of the shared database, if KVPOOL_REDIS_URL is set."""
    return os.environ.get(REDIS_URL_VARIABLE) or None


def connect_redis(url: str, timeout: float = REDIS_TIMEOUT) -> Any:
    """A client for ``url`` that has answered a ping; RedisUnavailable (one line) if none."""
    try:
        import redis
    except ImportError:
        raise RedisUnavailable(
            f"{REDIS_URL_VARIABLE} is set but the redis client is not installed "
            "(pip install 'kvpool[fuzz]')"
        ) from None
    shown = _without_password(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        client.ping()
    except ValueError as error:  # a malformed URL (bad scheme, port or database index)
        raise RedisUnavailable(
            f"{REDIS_URL_VARIABLE}={shown!r} is not a Redis URL: {error}"
        ) from None
    except redis.exceptions.AuthenticationError as error:
        raise RedisUnavailable(f"Redis at {shown} refused the credentials: {error}") from None
    except redis.exceptions.TimeoutError:
        raise RedisUnavailable(f"Redis at {shown} did not answer within {timeout:g} s") from None
    except redis.exceptions.RedisError as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RedisUnavailable(f"Redis at {shown} cannot be used: {text}") from None
    except OSError as error:
        raise RedisUnavailable(f"Redis at {shown} cannot be reached: {error}") from None
    return client


def _without_password(url: str) -> str:
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


def check_redis(url: str | None = None) -> str | None:
    """None if the shared Redis (``url`` or KVPOOL_REDIS_URL) is usable, else why not (one line).

    Also None when no Redis is configured.
    """
    url = url if url is not None else redis_url()
    if url is None:
        return None
    try:
        connect_redis(url).close()
    except RedisUnavailable as problem:
        return str(problem)
    return None


class _Tolerant(ExampleDatabase):
    """A database that drops itself, with one note, the first time it fails (a Redis gone away)."""

    def __init__(self, inner: ExampleDatabase, name: str, notes: list[str]) -> None:
        super().__init__()
        self.inner = inner
        self.name = name
        self.notes = notes
        self.broken = False

    def _failed(self, error: Exception) -> None:
        if not self.broken:
            self.broken = True
            self.notes.append(
                f"{self.name} failed during the run ({type(error).__name__}: {error}); "
                "the rest of the run used the local example database only"
            )

    def fetch(self, key: bytes) -> Iterable[bytes]:
        if self.broken:
            return []
        try:
            return list(self.inner.fetch(key))
        except Exception as error:  # any client failure: drop the database
            self._failed(error)
            return []

    def save(self, key: bytes, value: bytes) -> None:
        if not self.broken:
            try:
                self.inner.save(key, value)
            except Exception as error:
                self._failed(error)

    def delete(self, key: bytes, value: bytes) -> None:
        if not self.broken:
            try:
                self.inner.delete(key, value)
            except Exception as error:
                self._failed(error)


class CountingDatabase(ExampleDatabase):
    """Wraps the run's database and counts the programs it handed back to be replayed."""

    def __init__(self, inner: ExampleDatabase) -> None:
        super().__init__()
        self.inner = inner
        self.fetched = 0

    def fetch(self, key: bytes) -> Iterable[bytes]:
        for value in self.inner.fetch(key):
            self.fetched += 1
            yield value

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)


def shared_database(url: str, local: str | Path, key_prefix: str = "kvpool:") -> ExampleDatabase:
    """A directory database at ``local`` multiplexed with the Redis at ``url``.

    For harnesses of one's own (a HypoFuzz test file, say); ``kvpool check``
    and ``run_machine`` build theirs with ``database_for``. RedisUnavailable
    if the Redis cannot be used.
    """
    from hypothesis.extra.redis import RedisExampleDatabase

    client = connect_redis(url)
    return MultiplexedDatabase(
        DirectoryBasedExampleDatabase(str(local)),
        RedisExampleDatabase(client, key_prefix=key_prefix.encode()),
    )


def database_for(
    layer: str, target: str, choice: DatabaseChoice, notes: list[str]
) -> ExampleDatabase | None:
    """The example database of ``target`` at ``layer``; problems go to ``notes`` as lines.

    Raises RedisUnavailable if ``choice`` is REDIS and Redis cannot be used.
    """
    if choice is DatabaseChoice.NONE:
        return None
    local = local_database(layer, target)
    url = redis_url()
    if choice is DatabaseChoice.LOCAL or (url is None and choice is DatabaseChoice.AUTO):
        return local
    if url is None:
        raise RedisUnavailable(
            f"a shared database was asked for but {REDIS_URL_VARIABLE} is not set"
        )
    try:
        client = connect_redis(url)
    except RedisUnavailable as problem:
        if choice is DatabaseChoice.REDIS:
            raise
        notes.append(f"{problem}; the local example database was used instead")
        return local
    from hypothesis.extra.redis import RedisExampleDatabase

    shared = RedisExampleDatabase(
        client, key_prefix=f"kvpool:{target_key(layer, target)}:".encode()
    )
    return MultiplexedDatabase(
        local, _Tolerant(shared, f"Redis at {_without_password(url)}", notes)
    )
