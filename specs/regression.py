"""Counterexamples people can act on: where target and model part, and a regression test.

``run_conformance`` records every call the machine makes on the target
(``Recorder``). When the run fails, the calls of the last program Hypothesis
ran (the minimal one it prints) are replayed on the model to find the step
where the two part, the two states (or results) are laid side by side, the
invariants the target's state breaks are named, and the program is written
out twice: as a pytest test that replays it step by step (``Replay``) and as
a conformance vector (``kvpool vectors run FILE --target ...``).
"""

import difflib
import hashlib
import json
import math
import pprint
import textwrap
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from kvpool.model import CacheRequest, HashKey, KVCacheEvent, PoolConfig, PoolError, PoolState
from kvpool.specs import protocol
from kvpool.specs.adapters.model_target import ModelTarget
from kvpool.specs.invariants import (
    STATE_INVARIANTS,
    InvariantViolation,
    dump_state,
    event_stream_consistency,
    lru_order,
)
from kvpool.specs.protocol import Json
from kvpool.specs.target import PoolTarget, Snapshottable, TargetError, TargetFactory

QUERIES = ("get_num_free_blocks", "get_usage", "snapshot")
"""Calls the machine makes after every step to compare; not part of the program."""


# --------------------------------------------------------------------------
# Recording what the machine does to the target
# --------------------------------------------------------------------------


@dataclass
class Call:
    """One call on the target: operation, Python arguments, and its outcome."""

    op: str
    args: tuple[Any, ...]
    result: Any = None
    error: str | None = None

    def json_args(self) -> dict[str, Json]:
        return protocol.encode_args(self.op, *self.args)

    def outcome(self) -> dict[str, Json]:
        if self.error is not None:
            return {"error": self.error}
        return {"ok": protocol.encode_result(self.op, self.result)}


class Recorder:
    """Wraps a target factory; keeps the calls made on the latest target it built."""

    def __init__(self, make_target: TargetFactory) -> None:
        self.make_target = make_target
        self.config: PoolConfig | None = None
        self.calls: list[Call] = []
        self.inner: PoolTarget | None = None

    def __call__(self, config: PoolConfig) -> PoolTarget:
        self.config = config
        self.calls = []
        self.inner = self.make_target(config)
        if isinstance(self.inner, Snapshottable):
            return SnapshotRecordingTarget(self.inner, self)
        return RecordingTarget(self.inner, self)

    def record(self, op: str, args: tuple[Any, ...], run: Callable[[], Any]) -> Any:
        call = Call(op, tuple(list(a) if isinstance(a, list | set) else a for a in args))
        self.calls.append(call)
        try:
            call.result = run()
        except PoolError as error:
            call.error = type(error).__name__
            raise
        except TargetError:
            raise
        except Exception as error:
            call.error = type(error).__name__
            raise TargetError(crash_message(op, call.json_args(), error)) from error
        if isinstance(call.result, list):
            call.result = list(call.result)
        return call.result


def crash_message(op: str, args: dict[str, Json], error: BaseException) -> str:
    """What to say when a Python target raises something that is not a rejection."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    shown = json.dumps(args, separators=(", ", ": "), default=str)
    return (
        f"target error during {op} {shown}: the target raised {type(error).__name__}: "
        f"{error}{where}. Rejections must be the model's exceptions (kvpool.model.errors)."
    )


class RecordingTarget:
    """A target that tells its recorder about every call (other attributes pass through)."""

    def __init__(self, inner: PoolTarget, recorder: Recorder) -> None:
        self._inner = inner
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_new_blocks(self, num_blocks: int) -> Sequence[int]:
        result: Sequence[int] = self._recorder.record(
            "get_new_blocks", (num_blocks,), lambda: self._inner.get_new_blocks(num_blocks)
        )
        return result

    def touch(self, block_ids: Sequence[int]) -> None:
        self._recorder.record("touch", (block_ids,), lambda: self._inner.touch(block_ids))

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self._recorder.record(
            "free_blocks", (block_ids,), lambda: self._inner.free_blocks(block_ids)
        )

    def cache_full_blocks(
        self,
        request: CacheRequest,
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        args = (
            request,
            block_ids,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        self._recorder.record(
            "cache_full_blocks", args, lambda: self._inner.cache_full_blocks(*args)
        )

    def cache_partial_block(
        self,
        request: CacheRequest,
        block_id: int,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> HashKey | None:
        args = (request, block_id, num_tokens, kv_cache_group_id, block_size)
        key: HashKey | None = self._recorder.record(
            "cache_partial_block", args, lambda: self._inner.cache_partial_block(*args)
        )
        return key

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> Sequence[int] | None:
        args = (block_hash, kv_cache_group_ids)
        result: Sequence[int] | None = self._recorder.record(
            "get_cached_block", args, lambda: self._inner.get_cached_block(*args)
        )
        return result

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        ids = set(block_ids)
        self._recorder.record("evict_blocks", (ids,), lambda: self._inner.evict_blocks(ids))

    def reset_prefix_cache(self) -> bool:
        return bool(self._recorder.record("reset_prefix_cache", (), self._inner.reset_prefix_cache))

    def get_num_free_blocks(self) -> int:
        return int(
            self._recorder.record("get_num_free_blocks", (), self._inner.get_num_free_blocks)
        )

    def get_usage(self) -> float:
        return float(self._recorder.record("get_usage", (), self._inner.get_usage))

    def take_events(self) -> Sequence[KVCacheEvent]:
        events = tuple(self._recorder.record("take_events", (), self._inner.take_events))
        self._recorder.calls[-1].result = events
        return events


class SnapshotRecordingTarget(RecordingTarget):
    """A recording target whose inner target has ``snapshot()``."""

    def snapshot(self) -> PoolState:
        inner = self._inner
        assert isinstance(inner, Snapshottable)
        state: PoolState = self._recorder.record("snapshot", (), inner.snapshot)
        return state


# --------------------------------------------------------------------------
# Explaining a failure
# --------------------------------------------------------------------------


@dataclass
class BrokenInvariant:
    name: str
    reason: str
    doc: str


@dataclass
class Counterexample:
    """Everything the report shows about a divergence, as plain data."""

    step: int
    """1-based index of the program step where target and model part."""
    steps: int
    """Number of steps in the program."""
    operation: str
    """That step: operation name and JSON arguments."""
    problem: str
    compared: str
    """``state`` or ``result``: what ``model_side`` and ``target_side`` show."""
    model_side: str
    target_side: str
    invariants: list[BrokenInvariant] = field(default_factory=list)
    regression_test: str = ""
    vector: str = ""
    test_file: str | None = None
    vector_file: str | None = None


def explain(
    recorder: Recorder, target_name: str, failure: BaseException | None = None
) -> Counterexample | None:
    """The counterexample for the last program the recorder saw, or None if it saw none."""
    config = recorder.config
    if config is None:
        return None
    calls = list(recorder.calls)
    expected_model = ModelTarget(config)
    program: list[tuple[str, dict[str, Json]]] = []
    parted: tuple[int, str, str, str, str, Json | None] | None = None
    for call in calls:
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
            parted = (
                len(program),
                "result",
                _what(expected, actual),
                _show_outcome(expected),
                _show_outcome(actual),
                None,
            )
            break
    if not program:
        return None
    if parted is None:
        # Nothing recorded disagrees (an invariant failed on the model itself, say).
        state = dump_state(expected_model.state)
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
    operation = f"{op} {json.dumps(args, separators=(', ', ': '))}"
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


def _normal(target: object, config: PoolConfig, state: Json) -> Json:
    from kvpool.specs.vectors import normal_state

    return normal_state(target, state, config)


def _same(op: str, expected: dict[str, Json], actual: dict[str, Json], target: object) -> bool:
    if "error" in expected or "error" in actual:
        return expected == actual
    if op == "get_usage":
        return math.isclose(expected["ok"], actual["ok"], rel_tol=1e-9, abs_tol=1e-12)
    from kvpool.specs.vectors import same_result

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
    from kvpool.specs.vectors import dump_line, vector_from_calls

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


_UNSET: Any = object()


class Replay:
    """Replays a program on a target, step by step, against the model's answers.

    Generated regression tests use it; each mismatch is an AssertionError
    naming the step.
    """

    def __init__(self, target: str | TargetFactory, config: dict[str, Json]) -> None:
        from kvpool.specs.targets import resolve_target

        factory = resolve_target(target) if isinstance(target, str) else target
        self.config = protocol.decode_config(config)
        self.target: PoolTarget = factory(self.config)
        self.steps = 0

    def step(
        self, op: str, args: dict[str, Json], ok: Json = _UNSET, error: str | None = None
    ) -> None:
        """Run ``op``: it must return ``ok``, or be rejected with ``error``."""
        from kvpool.specs.vectors import check_step

        __tracebackhide__ = True
        self.steps += 1
        expect = {"error": error} if error is not None else {"ok": None if ok is _UNSET else ok}
        problem = check_step(self.target, {"op": op, "args": args, "expect": expect})
        if problem is not None:
            raise AssertionError(f"step {self.steps}, {op} {json.dumps(args)}: {problem}")

    def expect_state(self, state: dict[str, Json]) -> None:
        """The target's whole state must be ``state`` (checked if it has ``snapshot()``)."""
        from kvpool.specs.vectors import state_problem

        __tracebackhide__ = True
        found = state_problem(self.target, self.config, state)
        if found is not None:
            problem, diff = found
            raise AssertionError(f"after step {self.steps}: {problem}:\n{diff}")


# --------------------------------------------------------------------------
# Saving and showing
# --------------------------------------------------------------------------


def save(counterexample: Counterexample, directory: Path) -> None:
    """Write the regression test and the vector file into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tag = json.loads(counterexample.vector)["id"].split("/")[-1]
    test_file = directory / f"test_kvpool_regression_{tag}.py"
    vector_file = directory / f"kvpool_regression_{tag}.jsonl"
    test_file.write_text(counterexample.regression_test)
    vector_file.write_text(counterexample.vector + "\n")
    counterexample.test_file = str(test_file)
    counterexample.vector_file = str(vector_file)


def side_by_side(model_side: str, target_side: str) -> Table:
    """The two texts in two columns, aligned line by line, differences highlighted."""
    table = Table("model", "", "target", show_lines=False, expand=True)
    left = model_side.splitlines()
    right = target_side.splitlines()
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(left[i1:i2], right[j1:j2], strict=True):
                table.add_row(Text(a, style="dim"), "", Text(b, style="dim"))
            continue
        a_lines, b_lines = left[i1:i2], right[j1:j2]
        for k in range(max(len(a_lines), len(b_lines))):
            a = a_lines[k] if k < len(a_lines) else ""
            b = b_lines[k] if k < len(b_lines) else ""
            mark = "≠" if a and b else ("<" if a else ">")
            table.add_row(
                Text(a, style="bold green"), Text(mark, style="bold"), Text(b, style="bold red")
            )
    return table


def print_counterexample(console: Console, counterexample: Counterexample) -> None:
    """The terminal rendering of a counterexample (after the minimal program)."""
    c = counterexample
    console.print(
        f"[bold]Where they part:[/bold] step {c.step} of {c.steps}, ", end="", highlight=False
    )
    console.print(c.operation, markup=False, highlight=False)
    console.print(c.problem.splitlines()[0] if c.problem else "", markup=False, highlight=False)
    console.print(
        f"[bold]The two {'states' if c.compared == 'state' else 'results'} side by side[/bold] "
        "(≠ marks a difference, < and > a line on one side only):"
    )
    console.print(side_by_side(c.model_side, c.target_side))
    for broken in c.invariants:
        console.print(f"[bold red]Invariant broken on the target's state: {broken.name}[/bold red]")
        console.print(f"  {broken.reason}", markup=False, highlight=False)
        console.print(textwrap.indent(broken.doc, "  "), markup=False, highlight=False)
    where = f" (saved as {c.test_file})" if c.test_file else ""
    console.print(f"[bold]Regression test[/bold]{where}:")
    console.print(Syntax(c.regression_test, "python", theme="ansi_dark", word_wrap=True))
    if c.vector_file:
        console.print(
            f"[bold]The same program as a conformance vector:[/bold] {c.vector_file}\n"
            f"  kvpool vectors run {c.vector_file} --target ...",
            highlight=False,
        )
