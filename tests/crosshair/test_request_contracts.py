"""CrossHair over the request layer's contracts: clean on the model, and never vacuous.

As for the pool's (``test_contracts.py``): ``crosshair check`` with a
per-condition timeout (KVPOOL_CROSSHAIR_TIMEOUT, default 2 s), and every
counterexample CrossHair reports for a broken variant replayed in plain
Python before the test believes it.
"""

import inspect
from functools import cache

import pytest

from kvpool.specs.request import contracts
from tests.crosshair import request_catalogue
from tests.crosshair.test_contracts import ERROR, TIMEOUT, crosshair


def contract_line(line_number: int) -> str:
    return inspect.getsource(contracts).splitlines()[line_number - 1].strip()


@cache
def catalogue_findings() -> dict[str, list[tuple[str, str]]]:
    """Per broken contract: (failing condition text, the call CrossHair reported)."""
    result = crosshair("tests.crosshair.request_catalogue", "3")
    findings: dict[str, list[tuple[str, str]]] = {}
    for raw in result.stdout.splitlines():
        match = ERROR.match(raw)
        if match is None or not match["file"].endswith("request/contracts.py"):
            continue
        call = match["call"]
        name = call.split("(", 1)[0]
        condition = contract_line(int(match["line"])).removeprefix("post:").strip()
        findings.setdefault(name, []).append((condition, call))
    return findings


def test_crosshair_finds_no_counterexample_to_the_request_layer_contracts() -> None:
    result = crosshair("kvpool.specs.request.contracts", TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_contract_has_a_broken_variant() -> None:
    contracts_defined = {
        name
        for name, value in vars(contracts).items()
        if inspect.isfunction(value)
        and not name.startswith("_")
        and "post:" in (value.__doc__ or "")
    }
    assert contracts_defined == {v.contract for v in request_catalogue.CATALOGUE}


@pytest.mark.parametrize("variant", request_catalogue.CATALOGUE, ids=lambda v: v.contract)
def test_each_contract_catches_its_broken_variant(variant: request_catalogue.BrokenVariant) -> None:
    reported = catalogue_findings().get(f"broken_{variant.contract}", [])
    assert variant.catching_post in [condition for condition, _ in reported], reported


@pytest.mark.parametrize("variant", request_catalogue.CATALOGUE, ids=lambda v: v.contract)
def test_counterexamples_replay_in_plain_python(variant: request_catalogue.BrokenVariant) -> None:
    name = f"broken_{variant.contract}"
    calls = [
        call
        for condition, call in catalogue_findings().get(name, [])
        if condition == variant.catching_post
    ]
    assert calls, f"CrossHair reported no counterexample for {name}"
    # The call text is CrossHair's repr of plain ints and bools, evaluated without builtins.
    arguments_text = calls[0][len(name) :].split(" (which returns", 1)[0]
    arguments = eval(f"(lambda *a: a){arguments_text}", {"__builtins__": {}})
    function = getattr(request_catalogue, name)
    returned = function(*arguments)
    bound = inspect.signature(function).bind(*arguments).arguments
    namespace = dict(function.__globals__, __return__=returned, **bound)
    assert eval(variant.catching_post, namespace) is False
