"""CrossHair over the contracts: clean on the model, and never vacuous.

``crosshair check`` runs with a per-condition timeout (KVPOOL_CROSSHAIR_TIMEOUT,
default 2 s; raise it for a deeper run). Every counterexample CrossHair
reports for a broken variant is replayed in plain Python before the test
believes it.
"""

import inspect
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from kvpool.specs.pool import contracts
from tests.crosshair import catalogue

TIMEOUT = os.environ.get("KVPOOL_CROSSHAIR_TIMEOUT", "2")
ERROR = re.compile(r"^(?P<file>.+?):(?P<line>\d+): error: (?P<what>.*?) when calling (?P<call>.*)$")


def crosshair(target: str, timeout: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "crosshair",
            "check",
            "--analysis_kind",
            "PEP316",
            "--per_condition_timeout",
            timeout,
            target,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )


def contract_line(line_number: int) -> str:
    lines = inspect.getsource(contracts).splitlines()
    return lines[line_number - 1].strip()


@cache
def catalogue_findings() -> dict[str, list[tuple[str, str]]]:
    """Per broken contract: (failing condition text, the call CrossHair reported)."""
    result = crosshair("tests.crosshair.catalogue", "3")
    findings: dict[str, list[tuple[str, str]]] = {}
    for raw in result.stdout.splitlines():
        match = ERROR.match(raw)
        if match is None:
            continue
        call = match["call"]
        name = call.split("(", 1)[0]
        condition = contract_line(int(match["line"])).removeprefix("post:").strip()
        findings.setdefault(name, []).append((condition, call))
    return findings


def test_crosshair_finds_no_counterexample_to_the_model_contracts() -> None:
    result = crosshair("kvpool.specs.pool.contracts", TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", catalogue.CATALOGUE, ids=lambda v: v.contract)
def test_each_contract_catches_its_broken_variant(variant: catalogue.BrokenVariant) -> None:
    name = f"broken_{variant.contract}"
    reported = catalogue_findings().get(name, [])
    assert variant.catching_post in [condition for condition, _ in reported], reported


@pytest.mark.parametrize("variant", catalogue.CATALOGUE, ids=lambda v: v.contract)
def test_counterexamples_replay_in_plain_python(variant: catalogue.BrokenVariant) -> None:
    """CrossHair can report false counterexamples: replay each concretely."""
    name = f"broken_{variant.contract}"
    calls = [
        call
        for condition, call in catalogue_findings().get(name, [])
        if condition == variant.catching_post
    ]
    assert calls, f"CrossHair reported no counterexample for {name}"
    # The call text is CrossHair's repr of plain values (ints, bools, bytes, lists,
    # with := for shared values): our own tool's output, evaluated without builtins.
    arguments_text = calls[0][len(name) :].split(" (which returns", 1)[0]
    arguments = eval(f"(lambda *a: a){arguments_text}", {"__builtins__": {}})
    function = getattr(catalogue, name)
    returned = function(*arguments)
    bound = inspect.signature(function).bind(*arguments).arguments
    namespace = dict(function.__globals__, __return__=returned, **bound)
    assert eval(variant.catching_post, namespace) is False


def diffbehavior(first: str, second: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "crosshair",
            "diffbehavior",
            "--max_uninteresting_iterations",
            "20",
            first,
            second,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )


def test_diffbehavior_finds_no_difference_between_model_and_impl() -> None:
    result = diffbehavior(
        "kvpool.specs.pool.contracts.scenario_on_model",
        "kvpool.specs.pool.contracts.scenario_on_impl",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No differences found" in result.stdout


def test_diffbehavior_finds_a_planted_difference_and_it_replays() -> None:
    result = diffbehavior(
        "kvpool.specs.pool.contracts.scenario_on_model",
        "tests.crosshair.catalogue.scenario_on_broken_impl",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    call = re.search(r"Given: \((.*)\),", result.stdout)
    assert call is not None, result.stdout
    # CrossHair's own printout of plain ints, evaluated without builtins, then replayed.
    arguments = eval(f"(lambda **k: k)({call[1]})", {"__builtins__": {}})
    assert contracts.scenario_on_model(**arguments) != catalogue.scenario_on_broken_impl(
        **arguments
    )
