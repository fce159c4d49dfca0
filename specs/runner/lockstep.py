"""The lock-step helpers every layer's machine shares: one call on the model and the target.

A layer's state machine mixes in ``LockStep`` and describes each operation
as two callables: what it does to the model's state (a pure function
returning the new state and the result) and what it does to the target.
``LockStep`` runs the model first. A call the model rejects is not sent at
level 1 (it is counted with ``hypothesis.event``); at level 2 the target
must reject it with the same exception type and leave its state as it was.
A call the model accepts is sent, its result compared, and the model moves
on. Any difference raises the layer's ``Divergence``.

Exception *types* are compared, never messages (CrossHair's rule). A target
that raises something other than a rejection diverges, unless it is a
``TargetError`` (the target could not be run), which passes through.

Every call the target received is kept in ``trace``, with the model's
result, so a failure can name the program in the protocol's terms
(``program_lines``: one numbered step per operation the target received,
hashes in hex).

A target that recurses without end (``RecursionError``) or exhausts memory
is not diverging, it cannot be checked: those become ``TargetError``.
"""

import difflib
from collections.abc import Callable
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

from hypothesis import event

from kvpool.model.errors import PoolError
from kvpool.specs.errors import Divergence, TargetError
from kvpool.specs.runner.show import show

S = TypeVar("S")
"""The model's state type of the layer."""
Tgt = TypeVar("Tgt")
"""The target protocol of the layer."""
T = TypeVar("T")


class _Rejected:
    """The model's answer to a call it rejects, as a trace shows it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"rejected: {self.name}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Rejected) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


_NOTE = object()
"""The result of a trace line that is not a call (``LockStep._note``)."""


class LockStep(Generic[S, Tgt]):
    """Mixed into a layer's ``RuleBasedStateMachine``: the model, the target, and lock-step calls.

    Subclasses set ``model`` and ``target`` when a program starts, and may
    override ``_observe`` (called after every applied step) and
    ``divergence`` (the exception class raised when the two part).
    """

    level: ClassVar[int] = 1
    """1: only valid calls are sent; 2: invalid ones too, which must be rejected alike."""
    lockstep: ClassVar[bool] = True
    """False: drive the target alone (no model), checking only what needs no model."""
    divergence: ClassVar[type[Divergence]] = Divergence

    model: S | None
    target: Tgt | None
    trace: list[tuple[str, object]]
    """The calls sent to the target in this program, each with the model's result."""

    def _step(
        self,
        description: str,
        on_model: Callable[[S], tuple[S, T]],
        on_target: Callable[[Tgt], Any],
        *,
        returns_none: bool = False,
        **observed: Any,
    ) -> tuple[bool, T | None]:
        """Run one operation on both sides: (whether it was applied, the model's result).

        ``observed`` goes to ``_observe`` with the states before and after.
        """
        assert self.target is not None
        if not self.lockstep:
            actual = self._call(description, on_target)
            self.trace.append((description, actual))
            return True, None if returns_none else actual
        before = self.model
        assert before is not None
        try:
            after, expected = on_model(before)
        except PoolError as rejection:
            self._rejected_by_model(description, type(rejection), on_target)
            return False, None
        self.trace.append((description, expected))
        actual = self._call(description, on_target)
        self._compare(description, expected, None if returns_none else actual)
        self.model = after
        self._observe(before, after, **observed)
        return True, expected

    def _query(
        self,
        description: str,
        on_model: Callable[[S], T],
        on_target: Callable[[Tgt], Any],
    ) -> None:
        """Ask both sides something that changes neither; compare the answers."""
        assert self.model is not None
        try:
            expected = on_model(self.model)
        except PoolError as rejection:
            if self.level >= 2:
                self._rejected_by_model(description, type(rejection), on_target)
            return
        self.trace.append((description, expected))
        self._compare(description, expected, self._call(description, on_target))

    def _rejected_by_model(
        self, description: str, expected: type[PoolError], on_target: Callable[[Tgt], Any]
    ) -> None:
        if self.level < 2:
            event(f"level 1: invalid {description.split('(')[0]} not sent")
            return
        self.trace.append((description, _Rejected(expected.__name__)))
        self._expect_rejection(description, expected, on_target)

    def _call(self, description: str, on_target: Callable[[Tgt], Any]) -> Any:
        """The target's answer to a call the model accepts; any rejection diverges."""
        assert self.target is not None
        watched = _Watched(self.target)
        try:
            return on_target(watched)  # type: ignore[arg-type]
        except TargetError:
            raise
        except (RecursionError, MemoryError) as error:
            raise _cannot_check(description, error) from None
        except PoolError as error:
            self._diverge(description, f"the model accepts it, the target rejects it: {error!r}")
        except Exception as error:
            if watched.answered:
                raise TargetError(
                    f"target error during {description}: the target answered something the "
                    f"kit cannot read ({type(error).__name__}: {show(error)} while reading it)"
                ) from None
            self._diverge(description, f"the model accepts it, the target raises {show(error)}")

    def _expect_rejection(
        self,
        description: str,
        expected: type[PoolError],
        on_target: Callable[[Tgt], Any],
    ) -> None:
        """Send a call the model rejects: the target must reject it alike, changing nothing."""
        assert self.target is not None
        snapshot = getattr(self.target, "snapshot", None)
        before = snapshot() if snapshot is not None else None
        try:
            on_target(self.target)
        except TargetError:
            raise
        except (RecursionError, MemoryError) as error:
            raise _cannot_check(description, error) from None
        except PoolError as error:
            if type(error) is not expected:
                self._diverge(
                    description,
                    f"the model rejects it with {expected.__name__}, "
                    f"the target with {type(error).__name__}",
                )
        except Exception as error:
            self._diverge(
                description, f"the model rejects it with {expected.__name__}, the target {error!r}"
            )
        else:
            self._diverge(
                description,
                f"the model rejects it with {expected.__name__}, the target accepts it",
            )
        if snapshot is not None and snapshot() != before:
            self._diverge(description, "the target changed its state while rejecting the call")

    def _observe(self, before: S, after: S, **observed: Any) -> None:
        """Called after every step both sides applied; layers keep history here."""

    def _compare(self, description: str, expected: object, actual: object) -> None:
        try:
            differ = bool(expected != actual)
        except Exception as error:
            raise TargetError(
                f"target error during {description}: the target answered {show(actual)}, "
                f"which cannot be compared with the model's answer ({type(error).__name__}: "
                f"{error})"
            ) from None
        if differ:
            self._diverge(
                description, f"model returned {show(expected)}, target returned {show(actual)}"
            )

    def _diverge(self, description: str, what: str) -> NoReturn:
        raise self.divergence(f"{description}: {what}")

    def _note(self, line: str) -> None:
        """A line in the trace that is not a call on the target (how the program began)."""
        self.trace.append((line, _NOTE))

    def trace_lines(self) -> list[str]:
        """The calls of this program, one per line, with the model's results (hashes in hex)."""
        return [
            call if result is _NOTE else f"{call} -> {show(result)}" for call, result in self.trace
        ]

    def program_lines(self) -> list[str]:
        """The operations the target received, numbered as reports count steps.

        Lines that are not calls (how the program began) are not numbered.
        """
        lines = []
        number = 0
        for call, result in self.trace:
            if result is _NOTE:
                lines.append(call)
                continue
            number += 1
            lines.append(f"step {number}: {call} -> {show(result)}")
        return lines


class _Watched:
    """The target, telling whether its latest method call returned (then a failure that
    follows is in reading the answer, not in the target's call)."""

    def __init__(self, target: object) -> None:
        self._target = target
        self.answered = False

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._target, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self.answered = False
            answer = found(*args, **kwargs)
            self.answered = True
            return answer

        return call


def _cannot_check(description: str, error: BaseException) -> TargetError:
    what = "recursed without end" if isinstance(error, RecursionError) else "ran out of memory"
    return TargetError(
        f"target error during {description}: the target {what} ({type(error).__name__}); "
        "it cannot be checked"
    )


def dump_diff(expected: str, actual: str) -> str:
    """Two state dumps, the model's and the target's, as a unified diff."""
    lines = difflib.unified_diff(
        expected.splitlines(), actual.splitlines(), fromfile="model", tofile="target", lineterm=""
    )
    return "\n".join(lines)
