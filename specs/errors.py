"""What a conformance run can end with, other than "conforms": the kit's own exceptions.

Every layer and every adapter raises these, and the runner
(``kvpool.specs.runner``) sorts a failed run by them:

* ``Divergence``: the target and the model parted (exit 1);
* ``InvariantViolation``: a named invariant failed on a state (exit 1);
* ``TargetError``: the target itself could not be run, crashed, hung or
  answered garbage (exit 2: no verdict).

This module is the bottom floor of ``kvpool.specs``: it imports nothing of
kvpool's, so adapters can raise ``TargetError`` without importing the runner.
"""


class Divergence(AssertionError):
    """The target and the model parted: the message says where and how."""


class InvariantViolation(AssertionError):
    """A named invariant failed; the message names it, explains it and shows the state."""

    def __init__(self, name: str, reason: str, rationale: str, dump: str = "") -> None:
        self.name = name
        self.reason = reason
        text = f"invariant {name} violated: {reason}\n\n{rationale}"
        super().__init__(f"{text}\n\n{dump}" if dump else text)


class TargetError(Exception):
    """The target itself failed (crashed, hung, answered garbage): not a divergence."""


class TargetHang(TargetError):
    """One program ran past its time limit: the target loops or blocks."""


class TargetAbort(BaseException):
    """Carries a ``TargetError`` out of a Hypothesis run, which it must end at once.

    Hypothesis catches every ``Exception`` to replay and shrink the program;
    a broken program (crashed, hung) cannot be replayed, and each replay of a
    hang would wait for the timeout again. A ``BaseException`` passes through
    Hypothesis untouched; the runner and ``kvpool vectors run`` turn it back
    into the ``TargetError`` it carries (``error``).
    """

    def __init__(self, error: TargetError) -> None:
        super().__init__(str(error))
        self.error = error
