"""A pytest plugin: ``pytest --kvpool-target=...`` adds conformance checks to any suite.

Installed with kvpool (entry point ``pytest11``); it does nothing unless asked::

    pytest --kvpool-target=mypackage.adapter:make_target --kvpool-level=2
    pytest --kvpool-target="cmd:node pool.js" --kvpool-vectors
    pytest --kvpool-layer=request --kvpool-target=vllm:mypackage.fork:MyKVCacheManager

``--kvpool-target`` adds one test item, ``kvpool-conformance[TARGET]``, that
runs the lock-step machine (``run_conformance``) and fails with the report:
the minimal program, where the target parts from the model, and a
regression test, saved with its vector like ``kvpool check`` saves them
(``--kvpool-regression-dir``, default ``kvpool-regression``). A run that
reaches no verdict (the target crashed, exited, hung or was flaky; nothing
ran) fails the item too. ``--kvpool-vectors`` (optionally a directory) adds a second
item replaying the conformance vectors (the bundled corpus by default).
``--kvpool-layer`` picks the layer (``pool``, the default; ``request``, a KV
cache manager; ``v0``), as ``kvpool check --layer`` does.
"""

from pathlib import Path
from typing import Any

import pytest

from kvpool.model import PROFILES


class KvpoolFailure(Exception):
    """Raised by a kvpool item; its text is the whole report."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvpool", "kvpool block pool conformance")
    group.addoption(
        "--kvpool-target",
        default=None,
        help="Check this target against the kvpool model: impl, model, cmd:PROGRAM ARGS, "
        "or module:factory.",
    )
    group.addoption(
        "--kvpool-layer",
        default="pool",
        choices=("pool", "request", "v0", "manager"),
        help="The layer the target is checked at: pool (default), request (a KV cache "
        "manager; manager is its earlier name) or v0.",
    )
    group.addoption(
        "--kvpool-level",
        type=int,
        choices=(1, 2),
        default=1,
        help="1: valid operations only (default); 2: invalid ones too.",
    )
    group.addoption(
        "--kvpool-profile",
        action="append",
        default=None,
        choices=list(PROFILES),
        help="Semantics profile the target claims (repeatable; default hashless-first).",
    )
    group.addoption(
        "--kvpool-hypothesis-profile",
        default="ci",
        help="Hypothesis settings for the conformance run: ci (default), dev, deep or fuzz.",
    )
    group.addoption(
        "--kvpool-examples",
        type=int,
        default=None,
        help="Number of programs to run (default: the Hypothesis profile's).",
    )
    group.addoption(
        "--kvpool-steps",
        type=int,
        default=None,
        help="Operations per program (default: the Hypothesis profile's).",
    )
    group.addoption(
        "--kvpool-no-shrink",
        action="store_true",
        default=False,
        help="Show a failing program as it was found, not shrunk (same verdict, sooner).",
    )
    group.addoption(
        "--kvpool-record",
        default=None,
        metavar="DIR",
        help="Record the KV-cache calls of every vLLM engine the suite builds in-process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0) as histories in DIR; check each with "
        "kvpool history check.",
    )
    group.addoption(
        "--kvpool-regression-dir",
        default="kvpool-regression",
        help="Where a divergence's regression test and vector are written "
        "(default: kvpool-regression, as kvpool check).",
    )
    group.addoption(
        "--kvpool-vectors",
        nargs="?",
        const="",
        default=None,
        help="Also replay conformance vectors (a directory or .jsonl; default: the bundled "
        "corpus).",
    )


RECORDER = pytest.StashKey[Any]()


def pytest_configure(config: pytest.Config) -> None:
    """``--kvpool-record DIR``: record every in-process vLLM engine the suite builds."""
    directory = config.getoption("--kvpool-record", None)
    if not directory:
        return
    from kvpool.specs.targets.vllm.recorder import Recorder, RecorderError

    recorder = Recorder(directory=Path(directory))
    try:
        recorder.install()
    except RecorderError as error:
        raise pytest.UsageError(f"--kvpool-record: {error}") from None
    config.stash[RECORDER] = recorder


def pytest_runtest_setup(item: pytest.Item) -> None:
    recorder = item.config.stash.get(RECORDER, None)
    if recorder is not None:
        recorder.label = item.nodeid


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.stash.get(RECORDER, None)
    if recorder is not None:
        recorder.flush()
        recorder.uninstall()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    target = config.getoption("--kvpool-target")
    if not target:
        return
    items.append(ConformanceItem.from_parent(session, name=f"kvpool-conformance[{target}]"))
    vectors = config.getoption("--kvpool-vectors")
    if vectors is not None:
        items.append(VectorsItem.from_parent(session, name=f"kvpool-vectors[{target}]"))


class ConformanceItem(pytest.Item):
    """Runs ``run_conformance`` against ``--kvpool-target``."""

    def runtest(self) -> None:
        from kvpool.specs.checking import check
        from kvpool.specs.runner.render import print_counterexample, render_text, save, verdict
        from kvpool.specs.targets import TargetSpecError, resolve

        options = self.config.option
        layer = _layer(options)
        try:
            descriptor = resolve(layer, options.kvpool_target)
        except TargetSpecError as error:
            raise KvpoolFailure(str(error)) from None
        try:
            report = check(
                layer,
                descriptor,
                level=options.kvpool_level,
                profiles=options.kvpool_profile,
                hypothesis_profile=options.kvpool_hypothesis_profile,
                max_examples=options.kvpool_examples,
                steps=options.kvpool_steps,
                shrink=not options.kvpool_no_shrink,
            )
        except TargetSpecError as error:
            raise KvpoolFailure(str(error)) from None
        finally:
            close = getattr(descriptor.factory, "close", None)
            if close is not None:
                close()
        self.user_properties.append(("kvpool_programs_run", report.examples_run))
        if report.exit_code == 0:
            return
        lines = [f"{options.kvpool_target}: {report.failure_kind}: {verdict(report)}"]
        if report.counterexample is not None:
            directory = Path(options.kvpool_regression_dir)
            try:
                save(report.counterexample, directory)
            except OSError as error:
                lines.append(f"cannot write the regression files to {directory}: {error}")
        if report.program and report.failure_kind != "flaky":
            which = "Minimal failing program" if report.shrunk else "Failing program, not shrunk"
            lines += [f"{which} (the operations the target received):"]
            lines.append(report.program)
        if report.counterexample is not None:
            lines.append(render_text(print_counterexample, report.counterexample))
        else:
            lines.append(report.failure or "")
        lines.extend(f"note: {note}" for note in report.notes)
        raise KvpoolFailure("\n".join(lines))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, KvpoolFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


class VectorsItem(ConformanceItem):
    """Replays conformance vectors against ``--kvpool-target``."""

    def runtest(self) -> None:
        from kvpool.specs.targets import TargetSpecError, resolve_target
        from kvpool.specs.vectors import VectorFormatError, bundled_corpus, run_corpus, scan

        options = self.config.option
        if _layer(options) == "request":
            self._run_request_vectors()
            return
        if _layer(options) != "pool":
            raise KvpoolFailure(f"the {_layer(options)} layer has no conformance vectors")
        source = Path(options.kvpool_vectors) if options.kvpool_vectors else bundled_corpus()
        from kvpool.specs.errors import TargetAbort, TargetError

        try:
            factory = resolve_target(options.kvpool_target)
        except TargetSpecError as error:
            raise KvpoolFailure(str(error)) from None
        levels = list(range(1, options.kvpool_level + 1))
        try:
            result = run_corpus(factory, scan(source), levels, options.kvpool_profile)
        except (VectorFormatError, TargetError) as error:
            raise KvpoolFailure(str(error)) from None
        except TargetAbort as abort:
            raise KvpoolFailure(str(abort.error)) from None
        finally:
            close = getattr(factory, "close", None)
            if close is not None:
                close()
        problems = [m.describe() for m in result.mismatches]
        if result.target_error is not None:
            problems.append(f"target error: {result.target_error}")
        if problems:
            raise KvpoolFailure(
                f"{result.failed} of {result.run} vectors from {source} do not match:\n"
                + "\n\n".join(problems[:10])
            )
        if result.run == 0:
            raise KvpoolFailure(
                "no vector ran, so nothing was checked: "
                + result.why_nothing_ran(levels, options.kvpool_profile)
            )

    def _run_request_vectors(self) -> None:
        from kvpool.specs.checking import replay_request_vectors
        from kvpool.specs.errors import TargetAbort, TargetError
        from kvpool.specs.targets import TargetSpecError, resolve
        from kvpool.specs.vectors import VectorFormatError, bundled_corpus, load

        options = self.config.option
        source = (
            Path(options.kvpool_vectors) if options.kvpool_vectors else bundled_corpus("request")
        )
        descriptor = None
        try:
            vectors = load(source, layer="request")
            descriptor = resolve("request", options.kvpool_target)
            result = replay_request_vectors(
                descriptor,
                vectors,
                levels=list(range(1, options.kvpool_level + 1)),
                profiles=options.kvpool_profile,
            )
        except (TargetSpecError, VectorFormatError, TargetError) as error:
            raise KvpoolFailure(str(error)) from None
        except TargetAbort as abort:
            raise KvpoolFailure(str(abort.error)) from None
        finally:
            close = getattr(getattr(descriptor, "factory", None), "close", None)
            if close is not None:
                close()
        problems = [m.describe() for m in result.mismatches]
        if result.target_error is not None:
            problems.append(f"target error: {result.target_error}")
        if result.run == 0:
            problems.append(
                "no vector ran, so nothing was checked: none is in the target's levels and scope"
            )
        if problems:
            raise KvpoolFailure(
                f"{result.failed} of {result.run} request-layer vectors from {source} "
                "do not match:\n" + "\n\n".join(problems[:10])
            )


def _layer(options: Any) -> str:
    layer = str(options.kvpool_layer)
    return "request" if layer == "manager" else layer
