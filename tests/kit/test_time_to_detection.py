"""The report tells how long detection took: the first failure, then shrinking, apart.

Also: which build of kvpool.impl is loaded, and that ``kvpool check`` says so.
"""

import importlib.machinery

from typer.testing import CliRunner

from kvpool import impl
from kvpool.impl import pool as impl_pool
from kvpool.specs.cli import app
from kvpool.specs.conformance import run_conformance
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.runner.render import print_terminal, render_text
from tests.kit.buggy_pool import make_target


def test_a_divergence_reports_time_to_first_failure_apart_from_shrinking() -> None:
    report = run_conformance(make_target, hypothesis_profile="ci")
    assert not report.conforms
    assert report.programs_to_first_failure is not None
    assert 1 <= report.programs_to_first_failure <= report.examples_run
    assert report.seconds_to_first_failure is not None and report.shrink_seconds is not None
    assert 0 < report.seconds_to_first_failure <= report.seconds
    total = report.seconds_to_first_failure + report.shrink_seconds
    assert abs(total - report.seconds) < 1e-6
    text = render_text(print_terminal, report)
    assert f"program {report.programs_to_first_failure}, after" in text
    assert "(before shrinking)" in text and "shrinking" in text


def test_without_shrinking_the_first_failing_program_is_reported_as_found() -> None:
    shrunk = run_conformance(make_target, hypothesis_profile="ci")
    found = run_conformance(make_target, hypothesis_profile="ci", shrink=False)
    assert not shrunk.conforms and not found.conforms
    assert found.failure_kind == shrunk.failure_kind
    # The same programs run up to the failure; then only its replay for the report.
    assert found.programs_to_first_failure == shrunk.programs_to_first_failure
    assert found.programs_to_first_failure is not None
    assert found.examples_run == found.programs_to_first_failure + 1 < shrunk.examples_run
    assert found.program is not None and shrunk.program is not None
    assert len(found.program.splitlines()) > len(shrunk.program.splitlines())
    assert not found.shrunk and shrunk.shrunk
    assert "not shrunk: a failing program is shown as it was found" in found.notes
    assert not any("not shrunk" in note for note in shrunk.notes)
    text = render_text(print_terminal, found)
    assert "Failing program, not shrunk" in text and "Minimal failing program" not in text


def test_kvpool_check_no_shrink_gives_the_same_verdict() -> None:
    target = "tests.kit.buggy_pool:make_target"
    result = CliRunner().invoke(app, ["check", "--target", target, "--no-shrink"])
    assert result.exit_code == 1, result.output
    assert "not shrunk" in result.output


def test_an_events_check_without_shrinking_says_so() -> None:
    from kvpool.specs.events.check import check_events
    from kvpool.specs.events.model_target import ReferenceConsumer

    report = check_events(ReferenceConsumer, max_examples=3, steps=5, shrink=False)
    assert report.conforms and not report.shrunk
    assert "not shrunk: a failing program is shown as it was found" in report.notes


def test_a_conforming_run_reports_no_first_failure() -> None:
    report = run_conformance(ModelTarget, max_examples=5, steps=5)
    assert report.conforms
    assert report.programs_to_first_failure is None
    assert report.seconds_to_first_failure is None and report.shrink_seconds is None
    assert "first failure" not in render_text(print_terminal, report)


def test_compiled_says_whether_the_impl_is_an_extension_module() -> None:
    loaded = impl_pool.__file__ or ""
    is_extension = loaded.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert impl.COMPILED is is_extension


def test_kvpool_check_names_the_impl_build() -> None:
    result = CliRunner().invoke(app, ["check", "--examples", "2", "--steps", "3"])
    assert result.exit_code == 0, result.output
    build = "compiled with mypyc" if impl.COMPILED else "pure Python (not compiled)"
    assert f"kvpool.impl: {build}" in result.output
