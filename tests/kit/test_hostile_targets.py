"""``cmd:`` targets that misbehave in every way the survey tried, and what the kit says.

Each one gets exit 2 (no verdict) or 1 (a divergence) with a report naming
what happened, never a traceback, and leaves no process behind: the target
runs in a process group of its own, which the kit ends as a whole.
"""

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from kvpool.specs.targets.cmd.process import STDERR_TAIL, LineTooLong, TargetProcess
from tests.kit.helpers import (
    TARGETS,
    assert_no_traceback,
    kvpool_command,
    python_target,
    run_kvpool,
)

HANG_TIMEOUT = 8
"""Seconds the kit waits for a hanging target's answer in these tests."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _grandchild(pidfile: Path) -> int:
    deadline = time.monotonic() + 30
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.05)
    return int(pidfile.read_text())


def _behind_a_shell(pidfile: Path, mode: str) -> str:
    script = TARGETS / "forker.py"
    # "; true" keeps the shell alive as the target's parent (no exec of the last command).
    return f"cmd:sh -c '{sys.executable} {script} {pidfile} {mode}; true'"


@pytest.mark.parametrize(
    ("mode", "exit_code", "phrase"),
    [
        ("serve", 0, "conforms"),
        ("hang", 2, f"did not answer within {HANG_TIMEOUT} s"),
        ("crash", 2, "closed its output"),
    ],
)
def test_a_target_behind_a_shell_that_forks_leaves_no_process_behind(
    tmp_path: Path, mode: str, exit_code: int, phrase: str
) -> None:
    pidfile = tmp_path / "grandchild.pid"
    result = run_kvpool(
        "check",
        "--target",
        _behind_a_shell(pidfile, mode),
        "--hypothesis-profile",
        "ci",
        "--examples",
        "30",
        # Only the hang waits for a short timeout: on a loaded machine (CI has 2 cores) a slow
        # but good answer must not pass for a hang.
        env={"KVPOOL_CMD_TIMEOUT": str(HANG_TIMEOUT) if mode == "hang" else "120"},
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == exit_code, output
    assert phrase in output
    assert_no_traceback(result)
    grandchild = _grandchild(pidfile)
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), f"the grandchild {grandchild} outlived the check"


def test_ctrl_c_exits_130_and_ends_the_targets_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "COLUMNS": "200"}
    env.pop("CI", None)
    kit = subprocess.Popen(
        [*kvpool_command(), "check", "--target", _behind_a_shell(pidfile, "hang")],
        env={**env, "KVPOOL_CMD_TIMEOUT": "600"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    grandchild = _grandchild(pidfile)
    time.sleep(1.0)  # let the run reach the hanging free_blocks
    kit.send_signal(signal.SIGINT)
    out, err = kit.communicate(timeout=60)
    assert kit.returncode == 130, out + err
    assert "Traceback" not in out + err
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


@pytest.mark.parametrize(
    ("name", "args", "exit_code", "phrases"),
    [
        ("deep_reply", [], 2, ["nested deeper than 32 levels"]),
        ("long_line", [], 2, ["more than 16777216 bytes without a newline"]),
        ("stderr_flood", [], 2, ["the last line, with a colour code", "\\x1b[31m"]),
        ("bad_snapshot", ["missing-pending-events"], 2, ["missing field 'pending_events'"]),
        ("bad_snapshot", ["unsorted-cached"], 2, ["state field cached", "must be sorted"]),
        ("bad_hello", [], 2, ["unknown profile(s) ['hashles-first']"]),
        ("exits_early", [], 2, ["closed its output", "exit code: 0"]),
        ("flaky", [], 2, ["is flaky", "Run 1", "Run 2"]),
    ],
)
def test_a_hostile_target_gets_a_named_error_and_no_traceback(
    name: str, args: list[str], exit_code: int, phrases: list[str]
) -> None:
    result = run_kvpool(
        "check",
        "--target",
        " ".join([python_target(name), *args]),
        "--hypothesis-profile",
        "ci",
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == exit_code, output
    for phrase in phrases:
        assert phrase in output, output
    assert_no_traceback(result)


def test_a_line_past_the_bound_is_refused_and_one_within_it_read_whole() -> None:
    """Megabytes arrive in pieces: the bound holds, and a line within it arrives whole."""
    writer = (
        f"import sys; sys.stdout.write('x' * {3 * 2**20}); sys.stdout.flush(); "
        "sys.stdout.write('\\n')"
    )
    process = TargetProcess([sys.executable, "-c", writer], max_line=2**20)
    try:
        with pytest.raises(LineTooLong):
            process.receive(30)
    finally:
        process.stop()
    fitting = TargetProcess([sys.executable, "-c", writer], max_line=4 * 2**20)
    try:
        assert fitting.receive(30) == b"x" * (3 * 2**20)
    finally:
        fitting.stop()


def test_stderr_is_kept_as_a_bounded_tail() -> None:
    flood = (
        "import sys\nfor i in range(20000): sys.stderr.write(f'line {i} ' + 'y' * 1000 + '\\n')\n"
    )
    process = TargetProcess([sys.executable, "-c", flood])
    try:
        assert process.exit_code(60) == 0
        process.tail_reader.join(30)
        assert len(process.tail) <= 2 * STDERR_TAIL
        assert process.stderr_tail(1)[0].startswith("line 19999 ")
    finally:
        process.stop()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "soon", "1e309", "100000"])
def test_an_unusable_timeout_stops_before_running(value: str) -> None:
    result = run_kvpool(
        "check", "--target", python_target("wrong_ids"), env={"KVPOOL_CMD_TIMEOUT": value}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "KVPOOL_CMD_TIMEOUT must be a number of seconds" in output
    assert_no_traceback(result)


def test_junit_output_parses_whatever_the_target_string_and_stderr_hold(tmp_path: Path) -> None:
    weird = tmp_path / 'a "quoted" <dir> & more'
    weird.mkdir()
    script = weird / "pool.py"
    script.write_text((TARGETS / "stderr_flood.py").read_text())
    (weird / "_serve.py").write_text((TARGETS / "_serve.py").read_text())
    report = tmp_path / "report.xml"
    result = run_kvpool(
        "check",
        "--target",
        f"cmd:{sys.executable} '{script}'",
        "--format",
        "junit",
        "--output",
        str(report),
        "--hypothesis-profile",
        "ci",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    suite = ElementTree.parse(report).getroot()
    (case,) = suite.iter("testcase")
    assert '"quoted"' in (case.get("name") or "")
    (error,) = case.iter("error")
    assert "\\x1b[31m" in (error.text or "")
    assert suite.get("errors") == "1"
