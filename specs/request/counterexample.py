"""Counterexamples for the request layer: where a manager and the model part, and a regression test.

``run_request_conformance`` records every call the machine makes on the
target (``kvpool.specs.request.record``). When the run fails, the calls of
the last program Hypothesis ran (the minimal one it printed) are replayed on
the model to find the step where the two part; the two results (or whole
states, as JSON, with a diff) are laid side by side, and the program is
written out twice: as a pytest test replaying it step by step
(``kvpool.specs.regression.RequestReplay``) and as a request-layer vector
(``kvpool vectors run --layer request FILE --target ...``).

The hashes a target computes itself are its own: they are not compared
with the model's, but the regression test asks for them again and checks
them against the token ground truth, as the machine did.
"""

import hashlib
import json
import math
import pprint
from collections.abc import Sequence

from kvpool.model import PoolError
from kvpool.specs.errors import InvariantViolation
from kvpool.specs.pool.counterexample import _docstring, _literal
from kvpool.specs.protocol import request_codec as codec
from kvpool.specs.protocol.codec import Json
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.record import QUERIES, ManagerRecorder
from kvpool.specs.request.target import ManagerSetup, ManagerSnapshottable
from kvpool.specs.runner.lockstep import dump_diff
from kvpool.specs.runner.report import BrokenInvariant, Counterexample
from kvpool.specs.vectors.request_generate import dump_line, manager_vector_from_calls


def explain(
    recorder: ManagerRecorder, target_name: str, failure: BaseException | None = None
) -> Counterexample | None:
    """The counterexample for the last program the recorder saw, or None if it saw none."""
    setup = recorder.setup
    if setup is None:
        return None
    model = ModelManagerTarget(setup)
    program: list[tuple[str, dict[str, Json]]] = []
    hashed: list[dict[str, Json]] = []
    parted: tuple[int, str, str, str, str] | None = None
    for call in list(recorder.calls):
        args = call.json_args()
        if call.op == "block_hashes":
            hashed.append(args["request"])
            program.append((call.op, args))
            continue
        before = model.state
        expected: dict[str, Json]
        try:
            expected = {"ok": codec.apply(model, call.op, args)}
        except PoolError as error:
            expected = {"error": type(error).__name__}
            model.state = before
        actual = call.outcome()
        if call.op == "snapshot":
            wanted = codec.encode_manager_state(before)
            if "ok" in actual and actual["ok"] != wanted:
                parted = (
                    _steps(program),
                    "state",
                    "the target's state differs from the model's",
                    _dump(wanted),
                    _dump(actual["ok"]),
                )
                break
            continue
        if call.op not in QUERIES:
            program.append((call.op, args))
        if not _same(call.op, expected, actual):
            if call.op in QUERIES:
                program.append((call.op, args))
            parted = (
                _steps(program),
                "result",
                _what(expected, actual),
                _show(expected),
                _show(actual),
            )
            break
    if not program:
        return None
    if not _steps(program):
        return _hasher_only(setup, program, target_name, failure)
    if parted is None:
        state = _dump(codec.encode_manager_state(model.state))
        parted = (_steps(program), "state", str(failure or "no difference recorded"), state, state)
    step, compared, problem, model_side, target_side = parted
    program = _first_steps(program, step)
    calls = [(op, args) for op, args in program if op != "block_hashes"]
    op, args = calls[step - 1] if step <= len(calls) else calls[-1]
    operation = f"{op} {_short(json.dumps(args, separators=(', ', ': ')))}"
    invariants = []
    if isinstance(failure, InvariantViolation):
        rationale = str(failure).split("\n\n")[1] if "\n\n" in str(failure) else ""
        invariants.append(BrokenInvariant(failure.name, failure.reason, rationale))
    vector_line, tag = _vector_line(setup, calls, target_name)
    test = regression_test(
        target_name,
        setup,
        program,
        tag,
        step,
        operation,
        problem,
        isinstance(recorder.inner, ManagerSnapshottable),
    )
    return Counterexample(
        step=step,
        steps=len(calls),
        operation=operation,
        problem=problem,
        compared=compared,
        model_side=model_side,
        target_side=target_side,
        invariants=invariants,
        regression_test=test,
        vector=vector_line,
        layer="request",
    )


def _hasher_only(
    setup: ManagerSetup,
    program: Sequence[tuple[str, dict[str, Json]]],
    target_name: str,
    failure: BaseException | None,
) -> Counterexample:
    """A failure found before any manager call: the target's own hashes of the requests."""
    problem = str(failure or "the target's hashes do not name prefixes as the tokens do")
    invariants = []
    if isinstance(failure, InvariantViolation):
        problem = failure.reason
        rationale = str(failure).split("\n\n")[1] if "\n\n" in str(failure) else ""
        invariants.append(BrokenInvariant(failure.name, failure.reason, rationale))
    _, args = program[-1]
    vector_line, tag = _vector_line(setup, [], target_name)
    return Counterexample(
        step=len(program),
        steps=len(program),
        operation=f"block_hashes {_short(json.dumps(args, separators=(', ', ': ')))}",
        problem=problem,
        compared="result",
        model_side="a hash per prefix: equal tokens and extra keys, equal hashes; others differ",
        target_side=problem,
        invariants=invariants,
        regression_test=regression_test(
            target_name, setup, program, tag, len(program), "block_hashes", problem, False
        ),
        vector=vector_line,
        layer="request",
    )


def _steps(program: Sequence[tuple[str, dict[str, Json]]]) -> int:
    return sum(1 for op, _ in program if op != "block_hashes")


def _first_steps(
    program: Sequence[tuple[str, dict[str, Json]]], steps: int
) -> list[tuple[str, dict[str, Json]]]:
    """The program up to its ``steps``-th call (and the hasher checks before it)."""
    kept: list[tuple[str, dict[str, Json]]] = []
    for op, args in program:
        if op != "block_hashes" and _steps(kept) >= max(steps, 1):
            break
        kept.append((op, args))
    return kept


def _same(op: str, expected: dict[str, Json], actual: dict[str, Json]) -> bool:
    if "error" in expected or "error" in actual:
        return expected == actual
    if op == "usage":
        return isinstance(actual["ok"], float | int) and math.isclose(
            expected["ok"], actual["ok"], rel_tol=1e-9, abs_tol=1e-12
        )
    if op == "get_num_common_prefix_blocks" and actual["ok"] is None:
        return True
    return bool(expected == actual)


def _what(expected: dict[str, Json], actual: dict[str, Json]) -> str:
    if "error" in expected and "error" in actual:
        return f"the model rejects it with {expected['error']}, the target with {actual['error']}"
    if "error" in expected:
        return f"the model rejects it with {expected['error']}, the target accepts it"
    if "error" in actual:
        return f"the model accepts it, the target rejects it with {actual['error']}"
    return f"the model returns {expected['ok']!r}, the target returned {actual['ok']!r}"


def _show(outcome: dict[str, Json]) -> str:
    if "error" in outcome:
        return f"rejects it: {outcome['error']}"
    return "returns " + pprint.pformat(outcome["ok"], width=60)


def _dump(state: Json) -> str:
    return json.dumps(state, indent=1, sort_keys=False)


def state_diff(expected: Json, actual: Json) -> str:
    """Two manager states as JSON, the model's and the target's, as a unified diff."""
    return dump_diff(_dump(expected), _dump(actual))


def _short(text: str) -> str:
    return text if len(text) <= 300 else text[:297] + "..."


def _vector_line(
    setup: ManagerSetup, program: Sequence[tuple[str, dict[str, Json]]], target_name: str
) -> tuple[str, str]:
    """The program as one request-layer vector line, and the tag naming it."""
    vector = manager_vector_from_calls(
        setup,
        program,
        "regression",
        f"minimal program on which {target_name} diverged from the model",
        ["regression"],
    )
    tag = hashlib.sha256(dump_line(vector).encode()).hexdigest()[:8]
    vector["id"] = f"regression/{tag}"
    return dump_line(vector), tag


def regression_test(
    target_name: str,
    setup: ManagerSetup,
    program: Sequence[tuple[str, dict[str, Json]]],
    tag: str,
    step: int,
    operation: str,
    problem: str,
    check_state: bool,
) -> str:
    """A self-contained pytest file replaying ``program`` with the model's expected answers."""
    lines = []
    model = ModelManagerTarget(setup)
    for op, args in program:
        if op == "block_hashes":
            head = "    manager.hashes("
            lines.append(f"{head}{_literal(args['request'], 4, len(head) - 4)})")
            continue
        try:
            outcome = f"ok={codec.apply(model, op, args)!r}"
        except PoolError as error:
            outcome = f"error={type(error).__name__!r}"
        head = f"    manager.step({op!r}, "
        lines.append(f"{head}{_literal(args, 4, len(head) - 4)}, {outcome})")
    if check_state:
        state = _literal(codec.encode_manager_state(model.state), 4, len("manager.expect_state("))
        lines.append(f"    manager.expect_state({state})")
    doc = _docstring(
        [
            "Regression test written by kvpool from a request-layer conformance failure.",
            "",
            f"{target_name} diverged from the model at step {step}, {operation}:",
            problem.splitlines()[0] if problem else "",
            "",
            "Run it with pytest. KVPOOL_TARGET picks another request-layer target: impl,",
            "model, vllm, vllm:module:Class, cmd:PROGRAM ARGS or module:factory.",
        ]
    )
    setup_literal = _literal(codec.encode_setup(setup), 4, len("manager = RequestReplay(TARGET, "))
    return "\n".join(
        [
            doc,
            "",
            "import os",
            "",
            "from kvpool.specs.regression import RequestReplay",
            "",
            f'TARGET = os.environ.get("KVPOOL_TARGET", {target_name!r})',
            "",
            "",
            f"def test_kvpool_request_regression_{tag}() -> None:",
            f"    manager = RequestReplay(TARGET, {setup_literal})",
            *lines,
            "",
        ]
    )
