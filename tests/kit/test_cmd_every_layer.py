"""``cmd:`` targets at every layer that has them (pool, request, events) share one process module.

So each layer gets the same guarantees: the program runs in a process group
of its own, ended as a whole (a grandchild started behind a shell does not
outlive the check, whether the program served, crashed or was stopped), and
everything it sends is bounded (deep and long answers, stderr floods and
garbage are named errors with exit 2, never a traceback).
"""

import shlex
import sys
import time
from pathlib import Path

import pytest

from tests.kit.helpers import TARGETS, assert_no_traceback, run_kvpool

SERVERS = {
    "pool": "-m kvpool.specs.protocol impl",
    "request": "-m kvpool.specs.protocol --layer request impl",
    "events": "-m kvpool.specs.protocol --consumer model",
}
"""The reference server of each layer's protocol, as arguments to Python."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.mark.parametrize("layer", list(SERVERS))
@pytest.mark.parametrize(("then", "exit_code"), [("serve", 0), ("crash", 2)])
def test_a_grandchild_behind_a_shell_does_not_outlive_the_check(
    tmp_path: Path, layer: str, then: str, exit_code: int
) -> None:
    pidfile = tmp_path / "grandchild.pid"
    # The shell starts a sleeper (its own pipes closed, as a daemon would), then serves the
    # layer's protocol or exits at once; "; true" keeps the shell as the sleeper's parent.
    server = f"{shlex.quote(sys.executable)} {SERVERS[layer]}" if then == "serve" else "exit 3"
    script = f"sleep 3600 </dev/null >/dev/null 2>&1 & echo $! > {pidfile}; {server}; true"
    result = run_kvpool(
        "check",
        "--layer",
        layer,
        "--target",
        f"cmd:sh -c {shlex.quote(script)}",
        "--examples",
        "10",
        "--steps",
        "10",
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == exit_code, output
    assert_no_traceback(result)
    if then == "crash":
        # The kit notices the exit on writing hello or on reading its answer, whichever comes.
        flat = " ".join(output.split())
        assert "exit code: 3" in flat, output
        assert "closed its output" in flat or "stopped reading its input" in flat, output
    grandchild = int(pidfile.read_text())
    assert _gone_soon(grandchild), f"the grandchild {grandchild} outlived the check at {layer}"


@pytest.mark.parametrize("layer", list(SERVERS))
@pytest.mark.parametrize(
    ("mode", "phrases"),
    [
        ("deep", ["nested deeper than 32 levels"]),
        ("long", ["more than 16777216 bytes without a newline"]),
        ("flood", ["closed its output", "exit code: 3", "the last line"]),
        ("garbage", ["not JSON", "DEBUG starting up {oops"]),
    ],
)
def test_what_a_target_sends_is_bounded_at_every_layer(
    layer: str, mode: str, phrases: list[str]
) -> None:
    result = run_kvpool(
        "check",
        "--layer",
        layer,
        "--target",
        f"cmd:{sys.executable} {TARGETS / 'any_layer.py'} {mode}",
        "--examples",
        "5",
        timeout=300,
    )
    output = result.stdout + result.stderr
    flat = " ".join(output.split())  # the report wraps long lines
    assert result.returncode == 2, output
    for phrase in phrases:
        assert phrase in flat, output
    assert_no_traceback(result)
