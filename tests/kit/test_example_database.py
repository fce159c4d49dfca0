"""The example database: kvpool's own, per layer and target; seeds replay nothing; Redis faults.

Hypothesis's default database is ``.hypothesis/`` in the working directory,
keyed the same for every target: a check there replayed another target's old
failure first. kvpool keeps each target's examples apart under its own home,
says when a failure came from there, and uses none with a seed. Redis (the
shared database) is checked before a run; a Redis that cannot be used is one
line and the local database, or exit 2 when the run asked for Redis.
"""

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit.helpers import assert_no_traceback, run_kvpool

BUGGY = "tests.kit.buggy_pool:make_target"


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = run_kvpool(
        "check",
        *args,
        cwd=tmp_path,
        env={"KVPOOL_HYPOTHESIS_DIR": str(tmp_path / "home"), **(env or {})},
    )
    assert_no_traceback(result)
    return result.returncode, result.stdout + result.stderr


def _json_report(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "report.json"
    code, output = _check(tmp_path, *args, "--format", "json", "--output", str(out))
    assert code in (0, 1), output
    report: dict[str, object] = json.loads(out.read_text())
    return report


def test_failures_are_kept_per_target_never_in_the_working_directory(tmp_path: Path) -> None:
    code, output = _check(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev")
    assert code == 1, output
    assert not (tmp_path / ".hypothesis").exists()
    saved = list((tmp_path / "home" / "pool").iterdir())
    assert len(saved) == 1 and saved[0].name.startswith("tests-kit-buggy_pool-make_target-")
    # Another target checked from the same directory replays nothing of the first's.
    code, output = _check(tmp_path, "--target", "impl", "--hypothesis-profile", "dev")
    assert code == 0, output


def test_a_stray_hypothesis_directory_is_not_read(tmp_path: Path) -> None:
    """A .hypothesis/ holding another target's failure, as Hypothesis itself would save it."""
    stray = tmp_path / "stray"
    code, _ = _check(
        tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev",
        env={"KVPOOL_HYPOTHESIS_DIR": str(stray)},
    )  # fmt: skip
    assert code == 1
    shutil.copytree(next((stray / "pool").iterdir()), tmp_path / ".hypothesis" / "examples")
    report = _json_report(tmp_path, "--target", "impl", "--hypothesis-profile", "dev")
    assert report["conforms"] is True and report["exit_code"] == 0


def test_the_report_says_when_a_failure_came_from_the_database(tmp_path: Path) -> None:
    first = _json_report(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev")
    assert first["failure_kind"] == "divergence" and first["from_database"] is False
    again = _json_report(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev")
    assert again["from_database"] is True
    assert any("replayed from the example database" in str(n) for n in again["notes"])  # type: ignore[attr-defined]
    _, output = _check(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev")
    assert "replayed from the example database" in output


def test_a_seeded_run_replays_nothing_and_saves_nothing(tmp_path: Path) -> None:
    _check(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev")  # saves a failure
    before = sorted(p.name for p in (tmp_path / "home").rglob("*"))
    one = _json_report(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev", "--seed", "7")
    two = _json_report(tmp_path, "--target", BUGGY, "--hypothesis-profile", "dev", "--seed", "7")
    assert one["from_database"] is False and two["from_database"] is False
    assert one["program"] == two["program"] and one["examples_run"] == two["examples_run"]
    assert sorted(p.name for p in (tmp_path / "home").rglob("*")) == before
    assert any("no example database" in str(n) for n in one["notes"])  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# Redis faults
# --------------------------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for s in held:
        s.close()
    server.close()


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _needs_redis_client() -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        if os.environ.get("KVPOOL_REQUIRE_REDIS") == "1":
            pytest.fail("KVPOOL_REQUIRE_REDIS=1 but the redis client is not installed")
        pytest.skip("the redis client is not installed (pip install 'kvpool[fuzz]')")


@pytest.mark.parametrize("url", ["not a url", "redis://localhost:notaport/0", "redis://:0/x"])
def test_a_malformed_redis_url_never_breaks_help(tmp_path: Path, url: str) -> None:
    for args in (["--help"], ["check", "--help"], ["vectors", "--help"], ["profiles"]):
        result = run_kvpool(*args, env={"KVPOOL_REDIS_URL": url})
        assert result.returncode == 0, result.stdout + result.stderr
        assert_no_traceback(result)


def _faulty_urls(silent: int) -> dict[str, tuple[str, str]]:
    return {
        "malformed": ("redis://localhost:notaport/0", "is not a Redis URL"),
        "refused": (f"redis://127.0.0.1:{_refused_port()}/0", "cannot be used"),
        "silent": (f"redis://127.0.0.1:{silent}/0", "did not answer within 2 s"),
    }


@pytest.mark.parametrize("fault", ["malformed", "refused", "silent"])
def test_an_unusable_redis_is_one_line_and_the_local_database(
    tmp_path: Path, fault: str, silent_port: int
) -> None:
    _needs_redis_client()
    url, phrase = _faulty_urls(silent_port)[fault]
    started = time.monotonic()
    code, output = _check(
        tmp_path, "--hypothesis-profile", "dev", "--examples", "5", env={"KVPOOL_REDIS_URL": url}
    )
    assert code == 0, output
    warnings = [line for line in output.splitlines() if phrase in line]
    assert len(warnings) == 1, output
    assert "using the local example database only" in warnings[0]
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("fault", ["malformed", "refused", "silent"])
def test_asking_for_redis_stops_before_running_when_it_is_unusable(
    tmp_path: Path, fault: str, silent_port: int
) -> None:
    _needs_redis_client()
    url, phrase = _faulty_urls(silent_port)[fault]
    code, output = _check(
        tmp_path,
        "--hypothesis-profile",
        "dev",
        "--database",
        "redis",
        env={"KVPOOL_REDIS_URL": url},
    )
    assert code == 2, output
    assert phrase in output and "stopped before running" in output
    assert "programs run" not in output


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    server = shutil.which("redis-server")
    if server is None:
        if os.environ.get("KVPOOL_REQUIRE_REDIS") == "1":
            pytest.fail("KVPOOL_REQUIRE_REDIS=1 but redis-server is not installed")
        pytest.skip("redis-server is not installed")
    port = _refused_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--requirepass", "sesame", "--databases", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("redis://:wrong@127.0.0.1:{port}/0", "refused the credentials"),
        ("redis://127.0.0.1:{port}/0", "refused the credentials"),
        ("redis://:sesame@127.0.0.1:{port}/9", "cannot be used"),
    ],
    ids=["wrong-password", "no-password", "bad-database-index"],
)
def test_a_redis_that_refuses_is_one_line_and_the_local_database(
    tmp_path: Path, redis_with_password: int, url: str, phrase: str
) -> None:
    _needs_redis_client()
    full = url.format(port=redis_with_password)
    code, output = _check(
        tmp_path, "--hypothesis-profile", "dev", "--examples", "5", env={"KVPOOL_REDIS_URL": full}
    )
    assert code == 0, output
    assert phrase in output and "using the local example database only" in output
    assert "sesame" not in output and ":wrong@" not in output
    code, output = _check(
        tmp_path, "--hypothesis-profile", "dev", "--examples", "5",
        env={"KVPOOL_REDIS_URL": f"redis://:sesame@127.0.0.1:{redis_with_password}/1"},
    )  # fmt: skip
    assert code == 0 and "Redis" not in output, output
