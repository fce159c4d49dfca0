"""Showing a ``ConformanceReport``: in a terminal, as JSON, as JUnit XML, and as files."""

import dataclasses
import difflib
import io
import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from xml.sax.saxutils import escape as escape_xml

from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from kvpool.specs.runner.report import ConformanceReport, Counterexample

T = TypeVar("T")


VERDICTS = {
    None: "conforms",
    "divergence": "diverges",
    "invariant": "diverges (an invariant broke)",
    "target-error": "no verdict: target error",
    "flaky": "no verdict: the target is flaky",
    "nothing-ran": "no verdict: nothing ran",
    "kit-error": "no verdict: the kit failed",
}
"""The one-line result of a run, by ``ConformanceReport.failure_kind``."""

TITLES = {
    "divergence": "diverges from the model",
    "invariant": "diverges from the model",
    "target-error": "could not be run",
    "flaky": "is flaky",
    "nothing-ran": "was not checked",
    "kit-error": "could not be checked",
}


def verdict(report: ConformanceReport) -> str:
    """The result line of ``report``: conforms, diverges, or why there is no verdict."""
    if report.conforms and report.examples_run == 0:
        return VERDICTS["nothing-ran"]
    return VERDICTS.get(report.failure_kind, f"no verdict: {report.failure_kind}")


def print_terminal(console: Console, report: ConformanceReport) -> None:
    """The report as ``kvpool check`` prints it: the failure, if any, then a summary table."""
    if not report.conforms:
        title = TITLES.get(report.failure_kind or "", "could not be checked")
        console.rule(Text(f"{report.target} {title}", style="red"))
        if report.program and report.failure_kind not in ("flaky",):
            which = "Minimal failing program" if report.shrunk else "Failing program, not shrunk"
            console.print(f"[bold]{which}[/bold] (the operations the target received):")
            console.print(report.program, markup=False, highlight=False)
        if report.counterexample is not None:
            print_counterexample(console, report.counterexample)
        else:
            console.print(f"[bold]What went wrong ({escape(report.failure_kind or '')}):[/bold]")
            console.print(report.failure or "", markup=False, highlight=False)
    for note in report.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    table = Table(title="kvpool check", show_header=False)
    table.add_row("target", Text(report.target))
    table.add_row("layer", report.layer)
    table.add_row("level", str(report.level))
    table.add_row("semantics profile(s)", Text(", ".join(report.profiles)))
    for profile, outcome in report.verdicts.items():
        claim = "claimed" if profile in report.claimed else "not claimed"
        table.add_row(Text(f"verdict under {profile} ({claim})"), Text(outcome))
    for part, outcome in report.parts.items():
        table.add_row(Text(f"part: {part}"), Text(outcome))
    table.add_row("Hypothesis profile", Text(report.hypothesis_profile))
    asked = f" (the run asked for {report.max_examples})" if report.max_examples else ""
    longest = f", up to {report.steps_per_program} steps each" if report.steps_per_program else ""
    table.add_row("programs run", f"{report.examples_run}{asked}{longest}")
    table.add_row("time", f"{report.seconds:.1f} s")
    if report.seconds_to_first_failure is not None:
        table.add_row(
            "first failure",
            f"program {report.programs_to_first_failure}, "
            f"after {report.seconds_to_first_failure:.2f} s (before shrinking)",
        )
        table.add_row("shrinking", f"{report.shrink_seconds or 0.0:.1f} s")
    good = report.exit_code == 0
    table.add_row("result", Text(verdict(report), style="green" if good else "red"))
    console.print(table)
    if good:
        console.print(Text(deeper(report), style="dim"))


def deeper(report: ConformanceReport) -> str:
    """One line on how to check more than this run did."""
    return (
        f"{report.examples_run} programs found no difference. To check deeper: "
        "--hypothesis-profile deep (20,000 programs of up to 120 steps) or --examples N; "
        "docs/how-to/how-much-checking.md says how much is enough."
    )


def to_json(report: ConformanceReport) -> str:
    """The report as a JSON document (every field of ``ConformanceReport``, and the exit code)."""
    document = dataclasses.asdict(report)
    document["exit_code"] = report.exit_code
    document["verdict"] = verdict(report)
    return json.dumps(document, indent=2)


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters XML 1.0 cannot hold at all, escaped or not (control characters, lone surrogates)."""


def xml_text(text: str) -> str:
    r"""``text`` made safe inside an XML element or a double-quoted attribute.

    >>> xml_text('a "b" <c>')
    'a &quot;b&quot; &lt;c&gt;'
    >>> xml_text(chr(27) + "[31m")
    '\\x1b[31m'
    """
    cleaned = _NOT_XML.sub(lambda m: repr(m.group())[1:-1], text)
    return escape_xml(cleaned, {'"': "&quot;"})


def to_junit(report: ConformanceReport) -> str:
    """The report as a JUnit XML test suite of one test case."""
    name = xml_text(f"kvpool check {report.target} level {report.level}")
    failure = ""
    counted = "failures" if report.exit_code == 1 else "errors"
    if report.exit_code != 0:
        body = xml_text(f"{report.program or ''}\n\n{report.failure or ''}")
        tag = "failure" if report.exit_code == 1 else "error"
        failure = f'<{tag} message="{xml_text(verdict(report))}">{body}</{tag}>'
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuite name="kvpool" tests="1" {counted}="{0 if report.exit_code == 0 else 1}" '
        f'time="{report.seconds:.3f}">\n'
        f'  <testcase classname="kvpool.check" name="{name}" time="{report.seconds:.3f}">'
        f"{failure}</testcase>\n</testsuite>\n"
    )


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
        layer = "" if c.layer == "pool" else f" --layer {c.layer}"
        console.print(
            f"[bold]The same program as a conformance vector:[/bold] {c.vector_file}\n"
            f"  kvpool vectors run {c.vector_file}{layer} --target ...",
            highlight=False,
        )


def render_text(printer: Callable[[Console, T], None], value: T, width: int = 120) -> str:
    """What ``printer(console, value)`` prints, as plain text (no colours)."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    printer(console, value)
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()
