"""The request layer checked in parts: the main scope, then what vLLM 0.33 added.

``kvpool check --layer request`` on kvpool's model and impl, and on vLLM 0.33, runs the main
scope and then each part of ``PARTS_033_HISPARSE`` (fine-grained hits, Mamba "align", hits
inside a Mamba block, HiSparse), which the main scope never draws. One report: each
part's verdict, programs and time added up, and the first failing part's failure.
"""

from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.model.request import Request
from kvpool.specs.checking import check
from kvpool.specs.cli import app
from kvpool.specs.request.target import PARTS_033_HISPARSE, ManagerSetup
from kvpool.specs.targets import TargetDescriptor, resolve
from kvpool.specs.targets.impl.request import ImplManagerTarget

PART_NAMES = ["main", *(name for name, _ in PARTS_033_HISPARSE)]
PARTS = {"impl": PARTS_033_HISPARSE, "model": PARTS_033_HISPARSE}
"""kvpool's model and impl are checked on the same parts, HiSparse included."""


@pytest.mark.parametrize("target", ["impl", "model"])
def test_kvpools_own_targets_are_checked_in_every_part(target: str) -> None:
    assert resolve("request", target).parts == PARTS[target]
    report = check("request", target, max_examples=10, steps=10)
    assert report.conforms, report.failure
    names = ["main", *(name for name, _ in PARTS[target])]
    assert list(report.parts) == names
    assert set(report.parts.values()) == {"conforms"}
    # every part ran its own budget
    assert report.examples_run >= 10 * len(names)


class HitlessBesideMamba(ImplManagerTarget):
    """Planted: beside a Mamba "align" group, never reports a cache hit."""

    def __init__(self, setup: ManagerSetup) -> None:
        super().__init__(setup)
        self.align = any(spec.mamba_align for spec in setup.specs)

    def get_computed_blocks(self, request: Request) -> Any:
        blocks, num_tokens = super().get_computed_blocks(request)
        if self.align and num_tokens:
            return tuple(() for _ in blocks), 0  # BUG
        return blocks, num_tokens


def test_a_bug_only_a_part_draws_is_found_in_that_part() -> None:
    impl = resolve("request", "impl")
    descriptor = TargetDescriptor(
        "request", "planted", HitlessBesideMamba, scope=impl.scope, parts=impl.parts
    )
    report = check("request", descriptor, max_examples=200, shrink=False)
    assert not report.conforms and report.exit_code == 1
    assert report.parts["main"] == "conforms"
    assert report.parts["fine-grained hits"] == "conforms"
    assert report.parts['Mamba "align"'].startswith("diverges")
    assert report.parts["hits inside a Mamba block"] == "not run"
    assert report.parts["HiSparse"] == "not run"
    assert report.programs_to_first_failure is not None
    assert report.programs_to_first_failure <= report.examples_run
    assert "get_computed_blocks" in (report.failure or "") + (report.program or "")
    assert any("the part 'Mamba \"align\"' failed" in note for note in report.notes)


def test_the_main_scope_alone_does_not_find_it() -> None:
    """What the parts add: the main scope never draws a Mamba "align" group."""
    impl = resolve("request", "impl")
    descriptor = TargetDescriptor("request", "planted", HitlessBesideMamba, scope=impl.scope)
    report = check("request", descriptor, max_examples=50, steps=10)
    assert report.conforms, report.failure
    assert report.parts == {}


def test_kvpool_check_shows_each_parts_verdict() -> None:
    result = CliRunner().invoke(
        app, ["check", "--layer", "request", "--target", "impl", "--examples", "5"]
    )
    assert result.exit_code == 0, result.output
    for name in PART_NAMES:
        assert f"part: {name}" in result.output
