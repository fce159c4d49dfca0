"""Two fuzzing workers share failures through a real Redis server.

Worker 1 generates programs against a buggy pool until it finds the bug,
shrinks it and saves it, to its own directory and to Redis. Worker 2, a
separate process with an empty directory of its own, runs the *reuse phase
only* (no generation at all): it can find the bug only by replaying what
Redis holds. A third worker pointed at another Redis database finds nothing,
so the replay came through the shared database and nowhere else.

Needs ``redis-server`` on the PATH and the ``redis`` client (``kvpool[fuzz]``):
skipped without them, unless KVPOOL_REQUIRE_REDIS=1, which makes their absence
a failure (CI sets it).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUG = "hashless-appended"
REQUIRED = os.environ.get("KVPOOL_REQUIRE_REDIS") == "1"


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"KVPOOL_REQUIRE_REDIS=1 but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    server = shutil.which("redis-server")
    if server is None:
        _unavailable("redis-server is not installed (apt-get install redis-server)")
    try:
        import redis
    except ImportError:
        _unavailable("the redis client is not installed (pip install 'kvpool[fuzz]')")
    assert server is not None
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def _worker(port: int, database: int, local: Path, mode: str, seed: int) -> dict[str, object]:
    env = dict(os.environ)
    env["KVPOOL_REDIS_URL"] = f"redis://127.0.0.1:{port}/{database}"
    env["KVPOOL_HYPOTHESIS_DIR"] = str(local)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.scale.worker", BUG, mode, str(seed)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_second_worker_replays_the_first_workers_failure_from_redis(
    redis_port: int, tmp_path: Path
) -> None:
    first = _worker(redis_port, 0, tmp_path / "worker1", "generate", seed=1)
    assert first["conforms"] is False, first
    assert isinstance(first["examples_run"], int) and first["examples_run"] > 1

    second_dir = tmp_path / "worker2"
    assert not second_dir.exists()
    second = _worker(redis_port, 0, second_dir, "reuse-only", seed=2)
    assert second["conforms"] is False, "worker 2 did not replay the failure from Redis"
    assert second["failure_kind"] == first["failure_kind"]
    assert second["program"] == first["program"]

    # The control: the same reuse-only worker on an empty Redis database finds nothing.
    control = _worker(redis_port, 1, tmp_path / "worker3", "reuse-only", seed=3)
    assert control["conforms"] is True and control["examples_run"] == 0, control
