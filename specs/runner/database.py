"""A shared example database for fuzzing workers.

Every worker (a process, on this machine or another) keeps its own directory
database and also writes to and reads from one Redis server::

    KVPOOL_REDIS_URL=redis://fuzz-host:6379/0 kvpool check --hypothesis-profile fuzz

A failure one worker finds and shrinks is saved to Redis; every other worker
replays it in its ``reuse`` phase before generating anything, and ``dev`` runs
on a laptop pointed at the same URL replay it too. Needs the ``redis`` client
(``pip install 'kvpool[fuzz]'``); importing this module does not.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
)

REDIS_URL_VARIABLE = "KVPOOL_REDIS_URL"
DEFAULT_LOCAL = Path(".hypothesis") / "examples"


def shared_database(redis_url: str, local: str | Path = DEFAULT_LOCAL) -> ExampleDatabase:
    """This worker's directory database multiplexed with the Redis one at ``redis_url``."""
    import redis
    from hypothesis.extra.redis import RedisExampleDatabase

    client = redis.Redis.from_url(redis_url)
    return MultiplexedDatabase(
        DirectoryBasedExampleDatabase(str(local)), RedisExampleDatabase(client)
    )


def use_shared_database(
    redis_url: str,
    local: str | Path = DEFAULT_LOCAL,
    profiles: tuple[str, ...] = ("dev", "deep", "fuzz"),
) -> None:
    """Re-register ``profiles`` (those with a database) to use the shared database."""
    database = shared_database(redis_url, local)
    for name in profiles:
        settings.register_profile(name, settings.get_profile(name), database=database)


def use_shared_database_from_env() -> bool:
    """Apply ``use_shared_database`` if KVPOOL_REDIS_URL is set; whether it was."""
    url = os.environ.get(REDIS_URL_VARIABLE)
    if not url:
        return False
    local = os.environ.get("KVPOOL_HYPOTHESIS_DIR", str(DEFAULT_LOCAL))
    use_shared_database(url, local)
    return True
