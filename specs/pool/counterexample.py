"""Counterexamples people can act on: where target and model part, and a regression test.

``run_conformance`` records every call the machine makes on the target
(``kvpool.specs.pool.record``). When the run fails, the calls of the last
program Hypothesis ran (the minimal one it prints) are replayed on the model
to find the step where the two part, the two states (or results) are laid
side by side, the invariants the target's state breaks are named, and the
program is written out twice: as a pytest test that replays it step by step
(``kvpool.specs.regression.Replay``) and as a conformance vector
(``kvpool vectors run FILE --target ...``).
"""

import hashlib
import json
import math
import pprint
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.model import PoolConfig, PoolError
from kvpool.specs.errors import InvariantViolation
from kvpool.specs.pool.invariants import (
    STATE_INVARIANTS,
    dump_state,
    event_stream_consistency,
    lru_order,
)
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.pool.record import QUERIES, Recorder
from kvpool.specs.pool.target import Snapshottable
from kvpool.specs.protocol import codec as protocol
from kvpool.specs.protocol.codec import Json
from kvpool.specs.runner.report import BrokenInvariant, Counterexample
from kvpool.specs.vectors.generate import dump_line, vector_from_calls
from kvpool.specs.vectors.replay import normal_state, same_result


@dataclass
class Walk:
    """The last recorded program replayed on the model: its steps, and where the two part."""

    config: PoolConfig
    program: list[tuple[str, dict[str, Json]]]
    """The operations the target received (the kit's own after-step queries left out,
    unless one is where the two part)."""
    outcomes: list[tuple[dict[str, Json], dict[str, Json]]]
    """Per step: the model's outcome and the target's (``{"ok": ...}`` or ``{"error": ...}``)."""
    parted: tuple[int, str, str, str, str, Json | None] | None
    """(step, compared, problem, model side, target side, target state) where they part."""
    model_state: Json


def walk(recorder: Recorder) -> Walk | None:
    """Replay the recorder's last program on the model, step by step, up to where they part."""
    config = recorder.config
    if config is None:
        return None
    expected_model = ModelTarget(config)
    program: list[tuple[str, dict[str, Json]]] = []
    outcomes: list[tuple[dict[str, Json], dict[str, Json]]] = []
    parted: tuple[int, str, str, str, str, Json | None] | None = None
    for call in list(recorder.calls):
        args = call.json_args()
        before = expected_model.state
        try:
            expected: dict[str, Json] = {"ok": protocol.apply(expected_model, call.op, args)}
        except PoolError as error:
            expected = {"error": type(error).__name__}
            expected_model.state = before
        actual = call.outcome()
        if call.op not in QUERIES:
            program.append((call.op, args))
            outcomes.append((expected, actual))
        if call.op == "snapshot":
            wanted = _normal(recorder.inner, config, protocol.encode_state(before))
            got = _normal(recorder.inner, config, actual.get("ok"))
            if wanted != got:
                parted = (
                    max(len(program), 1),
                    "state",
                    "the target's state differs from the model's",
                    dump_state(protocol.decode_state(wanted, config)),
                    dump_state(protocol.decode_state(got, config)),
                    got,
                )
                break
            continue
        if not _same(call.op, expected, actual, recorder.inner):
            if call.op in QUERIES:
                program.append((call.op, args))
                outcomes.append((expected, actual))
            parted = (
                len(program),
                "result",
                _what(expected, actual),
                _show_outcome(expected),
                _show_outcome(actual),
                None,
            )
            break
    if parted is not None:
        del program[max(parted[0], 1) :], outcomes[max(parted[0], 1) :]
    return Walk(config, program, outcomes, parted, protocol.encode_state(expected_model.state))


def program_lines(recorder: Recorder) -> list[str]:
    """The last program as the protocol operations the target received, one numbered step each.

    Each line shows the target's answer; the step where target and model
    part also shows the model's.
    """
    found = walk(recorder)
    if found is None:
        return []
    lines = [f"new_pool {_json(protocol.encode_config(found.config))}"]
    parted_at = found.parted[0] if found.parted is not None else None
    for number, ((op, args), (expected, actual)) in enumerate(
        zip(found.program, found.outcomes, strict=True), 1
    ):
        line = f"step {number}: {op} {_json(_brief(args))} -> {_outcome_text(actual)}"
        if number == parted_at and found.parted is not None and found.parted[1] == "result":
            line += f"   (the model: {_outcome_text(expected)})"
        elif number == parted_at:
            line += "   (after it, the target's state differs from the model's)"
        lines.append(line)
    return lines


def explain(
    recorder: Recorder, target_name: str, failure: BaseException | None = None
) -> Counterexample | None:
    """The counterexample for the last program the recorder saw, or None if it saw none."""
    found = walk(recorder)
    if found is None or not found.program:
        return None
    config, program, parted = found.config, found.program, found.parted
    if parted is None:
        # Nothing recorded disagrees (an invariant failed on the model itself, say).
        state = dump_state(protocol.decode_state(found.model_state, config))
        parted = (
            len(program),
            "state",
            str(failure or "no difference recorded"),
            state,
            state,
            None,
        )
    step, compared, problem, model_side, target_side, target_state = parted
    program = program[: max(step, 1)]
    op, args = program[step - 1]
    invariants = _broken_invariants(target_state, config, failure)
    vector_line, tag = _vector_line(config, program, target_name)
    operation = f"{op} {_json(args)}"
    test = regression_test(
        target_name,
        config,
        program,
        tag,
        step,
        operation,
        problem,
        target_state is not None or isinstance(recorder.inner, Snapshottable),
    )
    return Counterexample(
        step=step,
        steps=len(program),
        operation=operation,
        problem=problem,
        compared=compared,
        model_side=model_side,
        target_side=target_side,
        invariants=invariants,
        regression_test=test,
        vector=vector_line,
    )


def _brief(args: dict[str, Json]) -> dict[str, Json]:
    """``args`` with a request's chained hashes counted, not listed (the vector lists them)."""
    request = args.get("request")
    if not isinstance(request, dict):
        return args
    hashes = request.get("block_hashes")
    shown = {k: v for k, v in request.items() if v is not None and k != "block_hashes"}
    count = len(hashes) if isinstance(hashes, list) else 0
    return {**args, "request": {"block_hashes": f"<{count} chained hashes>", **shown}}


def _json(value: Json) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _outcome_text(outcome: dict[str, Json]) -> str:
    if "error" in outcome:
        return f"rejected: {outcome['error']}"
    text = _json(outcome["ok"])
    return text if len(text) <= 400 else text[:397] + "..."


def _normal(target: object, config: PoolConfig, state: Json) -> Json:
    return normal_state(target, state, config)


def _same(op: str, expected: dict[str, Json], actual: dict[str, Json], target: object) -> bool:
    if "error" in expected or "error" in actual:
        return expected == actual
    if op == "get_usage":
        return math.isclose(expected["ok"], actual["ok"], rel_tol=1e-9, abs_tol=1e-12)
    return same_result(op, expected["ok"], actual["ok"], target)


def _what(expected: dict[str, Json], actual: dict[str, Json]) -> str:
    if "error" in expected and "error" in actual:
        return f"the model rejects it with {expected['error']}, the target with {actual['error']}"
    if "error" in expected:
        return f"the model rejects it with {expected['error']}, the target accepts it"
    if "error" in actual:
        return f"the model accepts it, the target rejects it with {actual['error']}"
    return f"the model returns {expected['ok']!r}, the target returned {actual['ok']!r}"


def _show_outcome(outcome: dict[str, Json]) -> str:
    if "error" in outcome:
        return f"rejects it: {outcome['error']}"
    return "returns " + pprint.pformat(outcome["ok"], width=60)


def _broken_invariants(
    target_state: Json | None, config: PoolConfig, failure: BaseException | None
) -> list[BrokenInvariant]:
    broken: list[BrokenInvariant] = []
    docs = {f.__name__: f.__doc__ or "" for f in (*STATE_INVARIANTS, lru_order)}
    docs[event_stream_consistency.__name__] = event_stream_consistency.__doc__ or ""
    if isinstance(failure, InvariantViolation):
        broken.append(
            BrokenInvariant(failure.name, failure.reason, _clean(docs.get(failure.name, "")))
        )
    if target_state is not None:
        try:
            state = protocol.decode_state(target_state, config)
        except protocol.ProtocolError:
            return broken
        for invariant in STATE_INVARIANTS:
            try:
                reason = invariant(state)
            except (IndexError, KeyError, TypeError, ValueError) as error:
                reason = f"cannot be evaluated on this state ({error!r})"
            if reason is not None and all(b.name != invariant.__name__ for b in broken):
                broken.append(
                    BrokenInvariant(invariant.__name__, reason, _clean(docs[invariant.__name__]))
                )
    return broken


def _clean(doc: str) -> str:
    return textwrap.dedent("\n".join(doc.strip().splitlines()[1:])).strip() or doc.strip()


def _vector_line(
    config: PoolConfig, program: Sequence[tuple[str, dict[str, Json]]], target_name: str
) -> tuple[str, str]:
    """The program as one vector line, and the tag naming it (a hash of its content)."""
    vector = vector_from_calls(
        config,
        program,
        "regression",
        f"minimal program on which {target_name} diverged from the model",
        ["regression"],
    )
    tag = hashlib.sha256(dump_line(vector).encode()).hexdigest()[:8]
    vector["id"] = f"regression/{tag}"
    return dump_line(vector), tag


# --------------------------------------------------------------------------
# The regression test
# --------------------------------------------------------------------------


def regression_test(
    target_name: str,
    config: PoolConfig,
    program: Sequence[tuple[str, dict[str, Json]]],
    tag: str,
    step: int,
    operation: str,
    problem: str,
    check_state: bool,
) -> str:
    """A self-contained pytest file replaying ``program`` with the model's expected answers."""
    script_lines = []
    pool = ModelTarget(config)
    for op, args in program:
        try:
            outcome = f"ok={protocol.apply(pool, op, args)!r}"
        except PoolError as error:
            outcome = f"error={type(error).__name__!r}"
        head = f"    pool.step({op!r}, "
        script_lines.append(f"{head}{_literal(args, 4, len(head) - 4)}, {outcome})")
    if check_state:
        state = _literal(protocol.encode_state(pool.state), 4, len("pool.expect_state("))
        script_lines.append(f"    pool.expect_state({state})")
    doc = _docstring(
        [
            "Regression test written by kvpool from a conformance failure.",
            "",
            f"{target_name} diverged from the model at step {step}, {operation}:",
            problem.splitlines()[0] if problem else "",
            "",
            "Run it with pytest. KVPOOL_TARGET picks another target: impl, model,",
            "cmd:PROGRAM ARGS or module:factory.",
        ]
    )
    return "\n".join(
        [
            doc,
            "",
            "import os",
            "",
            "from kvpool.specs.regression import Replay",
            "",
            f'TARGET = os.environ.get("KVPOOL_TARGET", {target_name!r})',
            "",
            "",
            f"def test_kvpool_regression_{tag}() -> None:",
            f"    pool = Replay(TARGET, {_literal(protocol.encode_config(config), 4, 19)})",
            *script_lines,
            "",
        ]
    )


def _literal(value: Json, indent: int, used: int = 0, width: int = 96) -> str:
    """``value`` as a Python literal, split black-style over lines when it is too long.

    ``indent`` is the indentation of the line the value starts on, ``used``
    how many characters of that line come before it.

    >>> print(_literal({"a": [1, 2], "b": None}, 0, width=20))
    {
        'a': [1, 2],
        'b': None,
    }
    """
    flat = repr(value)
    if indent + used + len(flat) + 1 <= width or not isinstance(value, dict | list) or not value:
        return flat
    inner = " " * (indent + 4)
    if isinstance(value, dict):
        items = [
            f"{inner}{k!r}: {_literal(v, indent + 4, len(repr(k)) + 2, width)},"
            for k, v in value.items()
        ]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{inner}{_literal(v, indent + 4, 0, width)}," for v in value]
    return "[\n" + "\n".join(items) + "\n" + " " * indent + "]"


def _docstring(lines: list[str]) -> str:
    body = "\n".join(line.replace("\\", "\\\\").replace('"""', '\\"\\"\\"') for line in lines)
    return f'"""{body}\n"""'
