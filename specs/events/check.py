"""``check_events``: a consumer against the model's engines, or an engine against the fold.

The machine (``kvpool.specs.events.machine``) runs once per event semantics.
The report gives a verdict for each (``ConformanceReport.verdicts``); the
run conforms when the target is right under every semantics it claims
(``claimed``), and the failure shown is the first claimed one's. A failure
under a semantics the target does not claim is reported in the notes (with
its shrunk program), not as a failure: it says which contract the target is
*not* correct for.
"""

import hashlib
import json
from collections.abc import Callable, Collection, Sequence
from typing import Unpack

from kvpool.model import EVENT_SEMANTICS
from kvpool.specs.errors import TargetAbort, TargetError
from kvpool.specs.events.engine import model_engines
from kvpool.specs.events.machine import events_machine
from kvpool.specs.events.model_target import ReferenceConsumer
from kvpool.specs.events.target import ConsumerFactory, EngineFactory, claimed_semantics
from kvpool.specs.protocol.codec import Json
from kvpool.specs.runner.report import ConformanceReport, Counterexample
from kvpool.specs.runner.run import NOT_SHRUNK, RunOptions, run_machine

VERDICTS = ("conforms", "diverges", "target error")


def check_events(
    make_consumer: ConsumerFactory | None = None,
    make_engine: EngineFactory | None = None,
    *,
    semantics: Sequence[str] | None = None,
    claimed: Sequence[str] | None = None,
    preflight: Callable[[int, Sequence[str]], None] | None = None,
    without: Collection[str] = (),
    **options: Unpack[RunOptions],
) -> ConformanceReport:
    """Check a consumer (``make_consumer``) or a producer (``make_engine``); never raises for it.

    Exactly one of the two is the target: a consumer is checked against the
    model's engines, an engine factory against the reference consumer.
    ``semantics`` are the event semantics to run under (default: all);
    ``claimed`` those the verdict counts (default: ``semantics`` when given,
    else what the factory declares in ``event_semantics``, else all).
    ``without`` leaves engine steps out of every program (``ENGINE_STEPS``).
    ``options`` are the runner's (``kvpool.specs.runner.run.RunOptions``).

    >>> check_events(ReferenceConsumer, max_examples=5, steps=10).verdicts
    {'multiset': 'conforms', 'last-copy': 'conforms'}
    """
    if (make_consumer is None) == (make_engine is None):
        raise ValueError("check one consumer or one engine factory, not both or neither")
    under_test = "consumer" if make_consumer is not None else "producer"
    factory: object = make_consumer if make_consumer is not None else make_engine
    chosen = list(semantics or EVENT_SEMANTICS)
    unknown = [s for s in chosen if s not in EVENT_SEMANTICS]
    if unknown:
        raise ValueError(f"unknown event semantics {unknown}; known: {list(EVENT_SEMANTICS)}")
    target_name = options.get("target_name", "target")
    report = ConformanceReport(
        target=target_name,
        level=1,
        profiles=tuple(chosen),
        hypothesis_profile=options.get("hypothesis_profile", "ci"),
        layer="events",
    )
    if not options.get("shrink", True):
        report.shrunk = False
        report.notes.append(NOT_SHRUNK)
    try:
        if preflight is not None:
            preflight(1, chosen)
        if claimed is None:
            claimed = list(semantics) if semantics else list(claimed_semantics(factory))
    except TargetError as error:
        report.fail("target-error", error)
        return report
    except TargetAbort as abort:
        report.fail("target-error", abort.error)
        return report
    claims = tuple(s for s in chosen if s in claimed)
    report.claimed = claims
    report.notes.append(
        f"{target_name} is checked as a {under_test}; it claims "
        + (", ".join(claims) if claims else "none of the semantics checked")
    )
    consumer = make_consumer if make_consumer is not None else ReferenceConsumer
    engines = make_engine if make_engine is not None else model_engines()
    replay_on = target_name if under_test == "consumer" else "model"
    for name in chosen:
        machine = events_machine(
            consumer, engines, EVENT_SEMANTICS[name], under_test, without=without
        )
        part = run_machine(
            machine,
            level=1,
            profiles=(name,),
            explain=lambda failure, s=name: counterexample(failure, replay_on, s),  # type: ignore[misc]
            traced_program=True,
            **options,
        )
        _merge(report, part, name, name in claims)
    if not claims and report.conforms:
        # Zero is not a pass: runs under semantics nobody claimed decide nothing.
        report.fail(
            "nothing-ran",
            f"{target_name} claims none of the semantics checked ({', '.join(chosen)}): "
            "the verdicts above are for information, and no claim was checked",
        )
    return report


def _merge(report: ConformanceReport, part: ConformanceReport, name: str, claimed: bool) -> None:
    report.examples_run += part.examples_run
    report.seconds += part.seconds
    report.max_examples = part.max_examples
    report.steps_per_program = part.steps_per_program
    report.from_database = report.from_database or (claimed and part.from_database)
    if part.conforms and part.examples_run == 0:  # no verdict, whatever was claimed
        part.fail("nothing-ran", f"no program was run under {name}, so nothing was checked")
    verdict = {0: "conforms", 1: "diverges"}.get(part.exit_code, "no verdict")
    if part.failure_kind == "target-error":
        verdict = "target error"
    elif verdict == "no verdict":
        verdict = f"no verdict ({part.failure_kind})"
    report.verdicts[name] = verdict
    if part.exit_code == 0:
        return
    if claimed and report.conforms:
        report.conforms = False
        if part.seconds_to_first_failure is not None:
            # Counted from the start of the whole check: the profiles run before this one.
            before = report.seconds - part.seconds
            report.seconds_to_first_failure = before + part.seconds_to_first_failure
            report.programs_to_first_failure = (
                report.examples_run - part.examples_run + (part.programs_to_first_failure or 0)
            )
            report.shrink_seconds = part.shrink_seconds
        report.failure_kind = part.failure_kind
        report.failure = part.failure
        report.program = part.program
        report.counterexample = part.counterexample
        return
    why = "claimed" if claimed else "not claimed"
    first = (part.failure or "").splitlines()[0] if part.failure else ""
    report.notes.append(f"under {name} ({why}): {verdict}: {first}\n{part.program or ''}".rstrip())


def counterexample(failure: BaseException, target: str, semantics: str) -> Counterexample | None:
    """The failing program as a consumer vector (a JSON line) and a regression test replaying it.

    ``target`` is the consumer the vector fails on: the target itself, or the
    reference consumer (``model``) when a producer's stream is at fault.
    """
    program = getattr(failure, "events_program", None)
    if not isinstance(program, dict):
        return None
    steps: list[dict[str, Json]] = program["steps"]
    last = steps[-1] if steps else {}
    vector: dict[str, Json] = {
        "id": "",
        "description": str(failure).splitlines()[0],
        "tags": ["counterexample", f"semantics:{semantics}"],
        "event_semantics": semantics,
        "config": program["config"],
        "steps": steps,
        "known": {target: "mismatch"},
    }
    digest = hashlib.sha256(json.dumps(vector, sort_keys=True).encode()).hexdigest()[:10]
    vector["id"] = f"counterexample/{semantics}/{digest}"
    line = json.dumps(vector, separators=(",", ":"))
    expect = last.get("expect") if last.get("op") == "scores" else None
    said = program.get("said")
    if isinstance(expect, list) and isinstance(said, list):
        model_side = "\n".join(f"worker {w}: holds {n} block(s)" for w, n in enumerate(expect))
        target_side = "\n".join(f"worker {w}: scored {n}" for w, n in enumerate(said))
    else:
        model_side = "the last step is accepted"
        target_side = str(failure).splitlines()[0]
    return Counterexample(
        step=len(steps),
        steps=len(steps),
        operation=json.dumps(last.get("query", last), separators=(",", ":"))[:300],
        problem=str(failure).splitlines()[0],
        compared="result",
        model_side=model_side,
        target_side=target_side,
        regression_test=regression_test(digest, target),
        vector=line,
        layer="events",
    )


def regression_test(tag: str, target: str) -> str:
    """A pytest module replaying the saved vector against ``target``."""
    return f'''"""kvpool regression: {target} against the events vector saved beside this file."""

from pathlib import Path

from kvpool.specs.targets import resolve
from kvpool.specs.vectors.events import load, run_vector


def test_kvpool_regression_{tag}() -> None:
    [vector] = load(Path(__file__).with_name("kvpool_regression_{tag}.jsonl"))
    factory = resolve("events", {target!r}).factory
    mismatch = run_vector(factory, vector)
    assert mismatch is None, mismatch.describe()
'''
