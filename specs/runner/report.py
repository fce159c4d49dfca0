"""What one conformance run found, as plain data: the report every layer returns.

Running and rendering are apart: ``kvpool.specs.runner.run`` fills a
``ConformanceReport``; ``kvpool.specs.runner.render`` shows it in a terminal,
as JSON or as JUnit XML.
"""

from dataclasses import dataclass, field


@dataclass
class BrokenInvariant:
    """An invariant the target's state breaks, by name, with its reason and rationale."""

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
    layer: str = "pool"
    """The layer whose vector format ``vector`` is in (``kvpool vectors run --layer``)."""


@dataclass
class ConformanceReport:
    """What one conformance run found, whatever the layer."""

    target: str
    level: int
    profiles: tuple[str, ...]
    hypothesis_profile: str
    examples_run: int = 0
    seconds: float = 0.0
    programs_to_first_failure: int | None = None
    """Programs run up to and including the first failing one (None: none failed)."""
    seconds_to_first_failure: float | None = None
    """Seconds from the start of the run to the end of the first failing program."""
    shrink_seconds: float | None = None
    """Seconds after the first failure: shrinking it and replaying the minimal program."""
    conforms: bool = True
    failure_kind: str | None = None
    """``divergence``, ``invariant`` or ``target-error`` when it does not conform."""
    failure: str | None = None
    program: str | None = None
    """The minimal failing program, one call per line."""
    notes: list[str] = field(default_factory=list)
    counterexample: Counterexample | None = None
    """Where target and model part, side by side, and a regression test (divergences only)."""
    verdicts: dict[str, str] = field(default_factory=dict)
    """Layers run once per profile (events): ``conforms``, ``diverges`` or ``target error``
    for each profile run, claimed or not."""
    claimed: tuple[str, ...] = ()
    """Of ``profiles``, those the target claims: only their verdicts decide ``conforms``."""

    def fail(self, kind: str, failure: BaseException) -> None:
        """Record that the run ended with ``failure``, of ``kind``."""
        self.conforms = False
        self.failure_kind = kind
        self.failure = str(failure)
