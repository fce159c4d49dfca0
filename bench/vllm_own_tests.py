"""The bug corpus against vLLM's own test suite, beside kvpool (issue #8, item 3).

Every corpus bug that lives in code vLLM has is planted in vLLM's own class
(``bench/vllm_corpus_patches.py``). Then, for each bug:

* vLLM's ``tests/v1/core`` run against the patched class, in a child pytest
  with this module as a plugin (``-p vllm_own_tests``): the plugin replaces
  the methods on vLLM's class in place before collection, so every test sees
  the bug whether it imports ``BlockPool`` or builds a ``KVCacheManager``;
* kvpool's ``ci`` profile runs against the same patched class, as
  ``kvpool check --target vllm:bench.vllm_corpus_patches:Class`` would (the
  Python API, to get the result as data and to survey level 2).

First a baseline: vLLM's tests on unpatched vLLM. A test that does not pass
there (a Hugging Face model config it cannot download, an API the release
does not have) is left out of every count; the report says how many and why.

With ``--swap impl`` (or ``impl-manager``) it instead runs vLLM 0.33's own
``tests/v1/core`` block-pool and manager tests with ``kvpool.impl.BlockPool``
(or ``kvpool.impl.KVCacheManager``) swapped in for every reference to vLLM's
class, and lists what passes, what fails and why (issue #16, the drop-in)::

    python bench/vllm_own_tests.py --swap impl --tests-dir /path/to/vllm-0.33.0

``--tests-dir`` is an unpacked vLLM 0.33.0 source distribution (it has
``tests/``; the wheel does not): ``pip download vllm==0.33.0 --no-binary :all:
--no-deps -vvv`` names its address (then fails building its metadata), and
``curl -O`` of that address and ``tar xzf`` get it (docs/vllm-conformance.md).
kvpool's pool is built as a vLLM caller builds it: ``strict=False`` (vLLM's
semantics and key shapes) and an ``event_hook`` making vLLM's event classes
(``kvpool.impl.vllm_shape.CallerEvents``).

Run it, from the repository root, with an interpreter that has vLLM::

    /work/vllm-venv/bin/python bench/vllm_own_tests.py
    ... --vllm installed 0.28.0 --only takes-mru --output results.json
    ... --render results.json

``--vllm`` names what is patched: ``installed`` (the importable vLLM) and/or
releases from kvpool's release cache (``kvpool check --target vllm==X`` puts
them there). vLLM's test sources are not in the wheel: they are taken from a
git directory (``--git-dir``, ``--commit``) into ``--tests-dir`` outside the
repository, once. einops, which vLLM's test helpers import and the light
vLLM install lacks, is installed beside them with pip.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

TESTS_COMMIT = "455edc022b45bbb5a279cff21cd3a34e6371aadf"
"""vLLM main of 2026-08-18 ("[ModelRunnerV2] Support prompt embeds (#42963)"): the
newest vLLM whose tests can be had here (the snapshot of github:ivanium/vllm, a
fork). Its v1/core sources are those of 0.28.0; the v0.33.0 tag is in
github:vllm-project/vllm only, whose snapshot is over the fetch size limit."""
DEFAULT_GIT_DIR = Path("/work/.mirror/ivanium+vllm/repo")
CACHE = Path(os.environ.get("KVPOOL_CACHE", Path.home() / ".cache" / "kvpool"))
DEFAULT_TESTS_DIR = CACHE / "vllm-tests" / f"main-{TESTS_COMMIT[:9]}"
DEPS_DIR = CACHE / "vllm-tests" / "deps"
TEST_PATHS = (
    "tests/v1/core",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
    "tests/v1/__init__.py",
    "tests/__init__.py",
)
"""What is extracted: tests/v1/core and the helper module its utils import."""
NOT_RUN = {
    "tests/v1/core/test_scheduler_e2e.py": "builds an LLM: needs a full model",
    "tests/v1/core/test_reset_prefix_cache_e2e.py": "builds an LLM: needs a full model",
}
TEST_TIMEOUT = 60
"""Seconds one vLLM test may take before the plugin fails it (a bug can loop forever)."""


# ----------------------------------------------------------------------
# The pytest plugin (in the child that runs vLLM's tests)
# ----------------------------------------------------------------------

_outcomes: dict[str, dict[str, str]] = {}


def _alias_moved_names() -> None:
    """Let tests written before 0.33 import names 0.33 moved out of kv_cache_utils.

    0.33 moved the KV cache config planning into ``kv_cache_planning``; the
    tests import it from ``kv_cache_utils``. Re-exporting it there makes the
    module importable, so its other tests (hashing, the free queue) run.
    Names 0.33 no longer has at all fail when called.
    """
    import importlib

    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        return
    for name in dir(planning):
        if not name.startswith("__") and not hasattr(utils, name):
            setattr(utils, name, getattr(planning, name))
    for name in (
        "group_and_unify_kv_cache_specs",
        "_get_kv_cache_config_packed",
        "_use_packed_kv_cache_config",
    ):
        if not hasattr(utils, name):
            setattr(utils, name, _missing(name))


def _missing(name: str) -> Any:
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is not in this vLLM")

    return missing


SWAP_FILES = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_utils.py",
)
"""vLLM 0.33's tests of the block pool, the managers and the cache utilities."""

SWAPS = {
    "impl": ("vllm.v1.core.block_pool", "BlockPool"),
    "impl-manager": ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
}
"""What ``--swap`` replaces: vLLM's module and class, by kvpool.impl's class of that name."""


_SLICE_3 = (
    "HiSparse slice 3 (host prefix hits, adoption of copies): a prefix hit beside HiSparse "
    "is refused, HiSparseNotModelled"
)
_SLICE_4 = (
    "HiSparse slice 4 (host imports): external tokens beside HiSparse are refused, "
    "HiSparseNotModelled"
)
KNOWN_REASONS = {
    "test_hisparse_prefix_hit_adopts_gpu_shadow_pages": _SLICE_3,
    "test_hisparse_prefix_hit_under_pressure_adopts_surviving_copies": _SLICE_3,
    "test_hisparse_host_backed_request_accepts_local_prefix_hit": _SLICE_3,
    "test_hisparse_reused_copy_is_not_adopted": _SLICE_3,
    "test_hisparse_host_prefix_can_be_completed_by_indexer_offload": _SLICE_4,
    "test_hisparse_aborted_tail_restore_retains_both_endpoints": _SLICE_4,
    "test_host_receive_completion_without_spill_metadata": _SLICE_4,
    "test_hisparse_recomputation_does_not_complete_failed_host_import": _SLICE_4,
    "test_hisparse_host_import_ignores_unsealed_tail": _SLICE_4,
    "test_hisparse_external_import_uses_hard_gpu_footprint": _SLICE_4,
    "test_hisparse_external_import_survives_capacity_retry": _SLICE_4,
    "test_hisparse_inflight_host_import_reserves_remaining_gpu_pages": _SLICE_4
    + "; past it the test asks manager.coordinator.get_num_blocks_to_allocate (vLLM's "
    "internal count, not answered)",
    "test_hisparse_indexer_offload_is_capped_by_missing_host_prefix": "reads vLLM's "
    "coordinator internals (isinstance HybridKVCacheCoordinator, "
    "find_longest_cache_hit_per_group): a deliberate difference (kvpool.impl.coordinator)",
    "test_connector_completes_partial_prefix_without_importing_missing_host_kv": "calls "
    "get_computed_blocks(request, max_cache_hit_length), vLLM 0.33's second argument, which "
    "kvpool's manager (and model) lack; past it, coordinator.find_longest_cache_hit_per_group",
    "test_hisparse_host_cow_copy_is_drained_without_a_gpu_pool": "writes a single-type "
    "manager's private state (_partial_hit_reqs) and needs host copy-on-write (slice 5)",
    "test_hisparse_import_capacity_includes_hits_and_cow": "calls the source manager's "
    "get_num_blocks_to_allocate with vLLM's internal signature (a lead's decision, "
    "docs/hisparse.md 'The 55 tests'); host copy-on-write is slice 5",
    "test_hisparse_capacity_query_does_not_require_hot_blocks": "asks "
    "manager.coordinator.get_num_blocks_to_allocate, vLLM's internal count (not answered: "
    "kvpool.impl.coordinator)",
    "test_eagle_hybrid_mamba_hits_partial_prompt_boundary": "calls "
    "coordinator.find_longest_cache_hit_per_group (not answered: kvpool.impl.coordinator)",
    "test_pure_swa_retention_interval_caches_sparse_tails": "asserts the class name of vLLM's "
    "internal coordinator (kvpool's is a read-only view)",
}
"""Why each test that passes on vLLM still fails with ``--swap impl-manager``, by test function
(docs/vllm-conformance.md, docs/hisparse.md "The 55 tests"); the swap's JSON carries it."""


def _swap_in(kind: str) -> None:
    """Replace vLLM's class by kvpool.impl's everywhere it is (and will be) imported from."""
    import importlib

    module_name, class_name = SWAPS[kind]
    module = importlib.import_module(module_name)
    original = getattr(module, class_name)
    replacement = getattr(importlib.import_module("kvpool.impl"), class_name)
    # vLLM's semantics and shapes where kvpool differs on purpose (the impl's one
    # switch), and vLLM's own event classes with vLLM's hashes (the event hook)
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvpool.impl.vllm_shape import CallerEvents

    events = CallerEvents(
        BlockStored, BlockRemoved, AllBlocksCleared, external_hash=maybe_convert_block_hash
    )
    kvpool_class = replacement
    if class_name == "BlockPool":

        class VllmSemanticsBlockPool(kvpool_class):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, strict=False, event_hook=events, **kwargs)

        replacement = VllmSemanticsBlockPool
    else:

        class VllmSemanticsManager(kvpool_class):  # type: ignore[valid-type,misc]
            # take_events warns through vLLM's manager logger, which vLLM's tests watch
            logger = module.logger

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                # the manager builds its pool: the same switch and hook, set on it (and on
                # HiSparse's host pool, whose events the device pool's hook makes)
                self.block_pool.strict = False
                self.block_pool.event_hook = events
                if self.host_block_pool is not None:
                    self.host_block_pool.strict = False

        replacement = VllmSemanticsManager
        # every HiSparse test reaches the coordinator through this name (vLLM's tests import
        # it before any swap could reach their module, so it is replaced where it is defined)
        import vllm.v1.hisparse.coordinator as hisparse

        from kvpool.impl import get_hisparse_coordinator

        original_get = hisparse.get_hisparse_coordinator
        for loaded in list(sys.modules.values()):
            if getattr(loaded, "__name__", "").startswith(("vllm", "tests")) and (
                getattr(loaded, "get_hisparse_coordinator", None) is original_get
            ):
                loaded.get_hisparse_coordinator = get_hisparse_coordinator  # type: ignore[attr-defined]
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith(("vllm", "tests")) and (
            getattr(loaded, class_name, None) is original
        ):
            setattr(loaded, class_name, replacement)


def pytest_configure(config: Any) -> None:
    if "KVPOOL_VLLM_REPORT" not in os.environ:
        return
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    config.addinivalue_line("markers", "cpu_test: vLLM's marker for tests that need no GPU")
    if os.environ.get("KVPOOL_VLLM_SWAP"):
        _swap_in(os.environ["KVPOOL_VLLM_SWAP"])
        return
    _alias_moved_names()
    bug = os.environ.get("KVPOOL_VLLM_BUG")
    if bug:
        import vllm_corpus_patches

        missing = vllm_corpus_patches.missing_in_this_vllm(bug)
        if missing:
            _outcomes["_missing"] = {"outcome": "n/a", "why": " ".join(missing)}
        else:
            vllm_corpus_patches.apply(bug)
            _outcomes["_planted"] = {"outcome": "n/a", "why": bug}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    excluded_file = os.environ.get("KVPOOL_VLLM_EXCLUDE")
    if not excluded_file:
        return
    excluded = set(json.loads(Path(excluded_file).read_text()))
    kept = [item for item in items if item.nodeid not in excluded]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in excluded])
    items[:] = kept


def pytest_runtest_setup(item: Any) -> None:
    import signal

    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {TEST_TIMEOUT} s")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(TEST_TIMEOUT)


def pytest_runtest_teardown(item: Any) -> None:
    import signal

    signal.alarm(0)


def pytest_runtest_logreport(report: Any) -> None:
    if "KVPOOL_VLLM_REPORT" not in os.environ:
        return
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "why": ""})
    if report.failed and entry["outcome"] == "passed":
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["why"] = (crash.message if crash else str(report.longrepr)).splitlines()[0][:200]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session: Any) -> None:
    path = os.environ.get("KVPOOL_VLLM_REPORT")
    if path:
        Path(path).write_text(json.dumps(_outcomes))


# ----------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------


def ensure_tests(tests_dir: Path, git_dir: Path, commit: str) -> None:
    """Extract vLLM's tests at ``commit`` into ``tests_dir`` once, and einops beside them."""
    if not (tests_dir / "tests" / "v1" / "core").is_dir():
        if not git_dir.is_dir():
            sys.exit(
                f"no vLLM tests in {tests_dir} and no git directory {git_dir}: "
                "get a snapshot of vLLM's repository (e.g. github:ivanium/vllm) first"
            )
        tests_dir.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "--git-dir", str(git_dir), "archive", "--format=tar", commit, *TEST_PATHS],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tests_dir)], input=archive, check=True)
        (tests_dir / "COMMIT").write_text(commit + "\n")
    if not (DEPS_DIR / "einops").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, "--target", str(DEPS_DIR), "einops"], check=True)


def release_path(vllm: str) -> list[str]:
    """What goes first on PYTHONPATH to import ``vllm`` (a cached release, or nothing)."""
    if vllm == "installed":
        return []
    sys.path.insert(0, str(ROOT))
    from kvpool.specs.targets.vllm.releases import ensure_release

    return [str(ensure_release(vllm))]


def run_vllm_tests(
    vllm: str,
    bug: str | None,
    tests_dir: Path,
    excluded: list[str],
    swap: str = "",
    only_swap_files: bool = False,
) -> tuple[dict[str, dict[str, str]], float]:
    """vLLM's tests with ``bug`` planted (None: unpatched): outcome by test id, and seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        exclude = Path(tmp) / "exclude.json"
        exclude.write_text(json.dumps(excluded))
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([*release_path(vllm), str(BENCH), str(DEPS_DIR)]),
            KVPOOL_VLLM_REPORT=str(report),
            KVPOOL_VLLM_EXCLUDE=str(exclude),
            KVPOOL_VLLM_BUG=bug or "",
            KVPOOL_VLLM_SWAP=swap,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="ERROR",
            PYTHONWARNINGS="ignore",
        )
        command = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider"]
        command += ["-p", "vllm_own_tests", "-q", "--tb=no", "--continue-on-collection-errors"]
        if swap or only_swap_files:
            command += list(SWAP_FILES)
        else:
            command += ["tests/v1/core"] + [f"--ignore={path}" for path in NOT_RUN]
        start = time.monotonic()
        done = subprocess.run(
            command, cwd=tests_dir, env=env, capture_output=True, text=True, timeout=3600
        )
        seconds = time.monotonic() - start
        if not report.is_file():
            raise RuntimeError(f"vLLM's tests did not run:\n{done.stdout[-3000:]}{done.stderr}")
        return json.loads(report.read_text()), seconds


KVPOOL_CHILD = """
import dataclasses, json, os, sys, time
from kvpool.specs.targets.vllm.releases import (
    activate_release, installed_version, profile_for_release
)
release = os.environ.get("KVPOOL_VLLM_RELEASE") or None
activate_release(release)
sys.path.insert(0, "bench")
bug, cls, level = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
start = time.monotonic()
found = []
if bug in ("", "unpatched") or not bug.startswith("request:"):
    from kvpool.specs.conformance import run_conformance
    from kvpool.specs.targets.vllm.pool import VllmTargetFactory
    from kvpool.specs.targets.vllm.survey import survey_level2
    profile = profile_for_release(release or installed_version())
    factory = VllmTargetFactory(cls and f"bench.vllm_corpus_patches:{cls}")
    if level == 1:
        r = run_conformance(factory, level=1, profile=profile, hypothesis_profile="ci")
    else:
        found, r = survey_level2(factory, profile=profile, hypothesis_profile="ci")
        found = [[d.operation, d.model_error, d.vllm_reaction, d.finding and d.finding.key]
                 for d in found]
else:
    import vllm_corpus_patches
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE
    from kvpool.specs.request.check import run_request_conformance as run_manager_conformance
    from tests.corpus.request_bugs import REQUEST_BUGS
    name = bug.split(":", 1)[1]
    layouts = next(b.layouts for b in REQUEST_BUGS if b.name == name)
    vllm_corpus_patches.apply(name)
    spec = dataclasses.replace(VLLM_SCOPE, layouts=tuple(
        x for x in layouts if x in VLLM_SCOPE.layouts))
    r = run_manager_conformance(spec, hypothesis_profile="ci", target_name=name)
print(json.dumps({"conforms": r.conforms, "kind": r.failure_kind, "programs": r.examples_run,
                  "failure": (r.failure or "").strip().splitlines()[:1], "level2": found,
                  "seconds": time.monotonic() - start}))
"""


def run_kvpool(vllm: str, bug: str, class_name: str | None, level: int) -> dict[str, Any]:
    """kvpool's ``ci`` profile on the patched vLLM (``bug`` "unpatched": vLLM as installed)."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    if vllm != "installed":
        from kvpool.specs.targets.vllm.releases import release_environment

        release_path(vllm)
        env = release_environment(vllm, env)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", KVPOOL_CHILD, bug, class_name or "", str(level)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"kvpool's run failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall"] = time.monotonic() - start
    return result


def kvpool_not_applicable(vllm: str, patch: Any) -> str:
    """Why kvpool cannot be run on this patched vLLM, or ""."""
    if patch.layer == "pool":
        return ""
    if vllm != "installed":
        return "kvpool's vLLM manager adapter speaks 0.33's API"
    from kvpool.specs.targets.vllm.request import VLLM_SCOPE

    layouts = REQUEST_LAYOUTS.get(patch.bug, ())
    if not set(layouts) & set(VLLM_SCOPE.layouts):
        return "the manager adapter runs none of " + "/".join(layouts)
    return ""


def vllm_version(vllm: str) -> str:
    if vllm != "installed":
        return vllm
    from importlib.metadata import version

    return version("vllm")


# ----------------------------------------------------------------------
# Judging and rendering
# ----------------------------------------------------------------------

REQUEST_LAYOUTS: dict[str, tuple[str, ...]] = {}
"""Each request-layer bug's layouts (``tests/corpus/request_bugs.py``), filled by ``main``."""

LEVEL2_SIGNATURE = {
    "double-free-ignored": ("free_blocks", "BlockNotHeld"),
    "negative-count-inflates-free": ("get_new_blocks", "InvalidBlockCount"),
}
"""The rejection mismatch each level-2 bug shows as (operation, the model's exception)."""


def kvpool_verdict(bug: str, result: dict[str, Any], unpatched: dict[str, Any] | None) -> str:
    """How kvpool's run on a patched vLLM went, in a few words."""
    if bug in LEVEL2_SIGNATURE:
        if not result["conforms"] and result["kind"] != "divergence":
            return f"yes ({result['kind']})"
        op, error = LEVEL2_SIGNATURE[bug]
        hits = [d for d in result["level2"] if d[0] == op and d[1] == error]
        if not hits:
            return "no"
        before = [d for d in (unpatched or {}).get("level2", []) if d[:2] == [op, error]]
        also = ", as on unpatched vLLM" if before else ""
        return f"flags the call: {op} accepted (known finding {hits[0][3] or 'new'}{also})"
    if result["conforms"]:
        return "no"
    return f"yes ({result['kind']})"


def _cell_tests(entry: dict[str, Any], total: int) -> str:
    if entry.get("na"):
        return f"n/a: {entry['na']}"
    failing = entry["failing"]
    if not failing:
        return f"not caught: 0/{total}, {entry['tests_seconds']:.0f} s"
    names = ", ".join(f"`{n.split('::')[-1]}`" for n in failing[:3])
    more = f" +{len(failing) - 3}" if len(failing) > 3 else ""
    return f"**caught**: {len(failing)}/{total} ({names}{more}), {entry['tests_seconds']:.0f} s"


def _cell_kvpool(entry: dict[str, Any]) -> str:
    if entry.get("kvpool_na"):
        return f"n/a: {entry['kvpool_na']}"
    if "kvpool" not in entry:
        return "not run"
    return f"{entry['kvpool_verdict']}, {entry['kvpool']['wall']:.0f} s"


def summarize(results: dict[str, Any]) -> str:
    """The Markdown table and the baseline notes for docs/verification.md."""
    lines: list[str] = []
    for run in results["runs"].values():
        base = run["baseline"]
        lines.append(
            f"- vLLM {run['version']}: {len(run['included'])} of vLLM's tests pass unpatched "
            f"and are counted; {base['not_passing']} do not pass unpatched and are left out "
            f"(unpatched run {base['seconds']:.0f} s):"
        )
        for reason, count in sorted(base["reasons"].items(), key=lambda x: -x[1])[:8]:
            lines.append(f"  - {count} x {reason}")
    lines.append("")
    runs = list(results["runs"].values())
    header = ["bug", "layer", "lvl"]
    for run in runs:
        header += [f"vLLM's tests on {run['version']}", f"kvpool ci on {run['version']}"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for bug in results["bugs"]:
        row = [f"`{bug['name']}`", bug["layer"], str(bug["level"])]
        for run in runs:
            entry = run["bugs"].get(bug["name"], {"na": "not run", "kvpool_na": "not run"})
            row += [_cell_tests(entry, len(run["included"])), _cell_kvpool(entry)]
        lines.append("| " + " | ".join(row) + " |")
    notes = [b for b in results["bugs"] if b["note"]]
    if notes:
        lines.append("")
        lines.extend(f"- `{b['name']}`: {b['note']}" for b in notes)
    return "\n".join(lines)


def corpus() -> list[dict[str, Any]]:
    """Every corpus bug, pool then request layer: name, layer and conformance level."""
    from tests.corpus.bugs import BUGS

    bugs = [{"name": b.name, "layer": "pool", "level": b.level} for b in BUGS]
    try:
        from tests.corpus.request_bugs import REQUEST_BUGS
    except ImportError:
        return bugs
    for b in REQUEST_BUGS:
        REQUEST_LAYOUTS[b.name] = tuple(b.layouts)
        bugs.append({"name": b.name, "layer": "request", "level": 1})
    return bugs


def run_bug(
    vllm: str, bug: dict[str, Any], patches: Any, tests_dir: Path, baseline: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's tests and kvpool on one patched vLLM."""
    patch = patches.PATCHES.get(bug["name"])
    if patch is None:
        return {"na": "no patch written", "kvpool_na": "no patch written"}
    entry: dict[str, Any] = {}
    got, entry["tests_seconds"] = run_vllm_tests(
        vllm, bug["name"] if patch.expressible else None, tests_dir, baseline["excluded"]
    )
    if "_missing" in got:
        why = f"this vLLM has no {got['_missing']['why']}"
        return {"na": why, "kvpool_na": why}
    assert not patch.expressible or got["_planted"]["why"] == bug["name"]
    included = baseline["included"]
    entry["failing"] = sorted(n for n in included if got.get(n, {}).get("outcome") != "passed")
    entry["why"] = {n: got.get(n, {}).get("why", "not run") for n in entry["failing"][:5]}
    entry["kvpool_na"] = kvpool_not_applicable(vllm, patch)
    if not entry["kvpool_na"] and not baseline.get("no_kvpool"):
        if patch.layer == "request":
            entry["kvpool"] = run_kvpool(vllm, f"request:{bug['name']}", None, 1)
        else:
            cls = patch.class_name if patch.expressible else None
            entry["kvpool"] = run_kvpool(vllm, bug["name"], cls, bug["level"])
        if bug["level"] == 2 and "unpatched2" not in baseline:
            baseline["unpatched2"] = run_kvpool(vllm, "unpatched", None, 2)
        entry["kvpool_verdict"] = kvpool_verdict(
            bug["name"], entry["kvpool"], baseline.get("unpatched2")
        )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", nargs="+", default=["installed", "0.28.0"])
    parser.add_argument("--only", nargs="*", help="bug names (default: every one)")
    parser.add_argument("--tests-dir", type=Path, default=DEFAULT_TESTS_DIR)
    parser.add_argument("--git-dir", type=Path, default=DEFAULT_GIT_DIR)
    parser.add_argument("--commit", default=TESTS_COMMIT)
    parser.add_argument("--no-kvpool", action="store_true", help="run vLLM's tests only")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--render", type=Path, help="print the table of a results file")
    parser.add_argument(
        "--swap", choices=sorted(SWAPS), help="run vLLM 0.33's tests with kvpool.impl swapped in"
    )
    args = parser.parse_args()
    if args.render:
        print(summarize(json.loads(args.render.read_text())))
        return
    if args.swap:
        run_swap(args.swap, args.tests_dir, args.output)
        return
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(BENCH))
    ensure_tests(args.tests_dir, args.git_dir, args.commit)
    import vllm_corpus_patches as patches

    bugs = [b for b in corpus() if not args.only or b["name"] in args.only]
    for b in bugs:
        patch = patches.PATCHES.get(b["name"])
        b["note"] = patch.note if patch else "no patch written"
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "tests_commit": args.commit,
        "bugs": bugs,
        "runs": {},
    }
    for vllm in args.vllm:
        outcomes, seconds = run_vllm_tests(vllm, None, args.tests_dir, [])
        outcomes = {n: o for n, o in outcomes.items() if not n.startswith("_")}
        included = sorted(n for n, o in outcomes.items() if o["outcome"] == "passed")
        reasons: dict[str, int] = {}
        for o in outcomes.values():
            if o["outcome"] != "passed":
                key = f"{o['outcome']}: {o['why'][:100]}" if o["why"] else o["outcome"]
                reasons[key] = reasons.get(key, 0) + 1
        baseline: dict[str, Any] = {
            "included": included,
            "excluded": sorted(set(outcomes) - set(included)),
            "no_kvpool": args.no_kvpool,
        }
        run: dict[str, Any] = {
            "version": vllm_version(vllm),
            "included": included,
            "baseline": {
                "seconds": seconds,
                "not_passing": len(outcomes) - len(included),
                "reasons": reasons,
            },
            "bugs": {},
        }
        results["runs"][vllm] = run
        print(f"vLLM {run['version']}: {len(included)}/{len(outcomes)} pass unpatched", flush=True)
        for bug in bugs:
            entry = run_bug(vllm, bug, patches, args.tests_dir, baseline)
            run["bugs"][bug["name"]] = entry
            print(
                f"  {bug['name']}: {_cell_tests(entry, len(included))} | {_cell_kvpool(entry)}",
                flush=True,
            )
        if "unpatched2" in baseline:
            run["kvpool_unpatched_level2"] = baseline["unpatched2"]
    results["seconds"] = time.monotonic() - started
    if args.output:
        args.output.write_text(json.dumps(results, indent=1))
    print()
    print(summarize(results))
    print(f"\nwhole run: {results['seconds']:.0f} s")


def run_swap(swap: str, tests_dir: Path, output: Path | None) -> None:
    """vLLM's tests on vLLM, then with kvpool.impl swapped in: counts and every failure's reason."""
    ensure_tests_deps()
    vllm_outcomes, vllm_seconds = run_vllm_tests(
        "installed", None, tests_dir, [], only_swap_files=True
    )
    vllm_outcomes = {n: o for n, o in vllm_outcomes.items() if not n.startswith("_")}
    passing = sorted(n for n, o in vllm_outcomes.items() if o["outcome"] == "passed")
    excluded = sorted(set(vllm_outcomes) - set(passing))
    swapped, swapped_seconds = run_vllm_tests("installed", None, tests_dir, excluded, swap)
    failures = {
        n: swapped.get(n, {"outcome": "not run", "why": ""})
        for n in passing
        if swapped.get(n, {}).get("outcome") != "passed"
    }
    for name, entry in failures.items():
        function = name.split("::")[-1].split("[")[0]
        entry["reason"] = KNOWN_REASONS.get(function, "not known: a regression to look at")
    by_file: dict[str, list[int]] = {}
    for name in passing:
        counts = by_file.setdefault(name.split("::")[0].rsplit("/", 1)[-1], [0, 0])
        counts[0] += 1
        counts[1] += name not in failures
    results: dict[str, Any] = {
        "swap": swap,
        "vllm_tests": len(vllm_outcomes),
        "pass_on_vllm": len(passing),
        "pass_swapped": len(passing) - len(failures),
        "by_file": by_file,
        "failures": failures,
        "seconds": [vllm_seconds, swapped_seconds],
    }
    if output:
        output.write_text(json.dumps(results, indent=1))
    print(
        f"{swap}: {results['pass_swapped']} of the {len(passing)} tests that pass on vLLM pass "
        f"({100 * results['pass_swapped'] / max(1, len(passing)):.1f} %); "
        f"{len(vllm_outcomes) - len(passing)} do not pass on vLLM"
    )
    for file, (total, ok) in sorted(by_file.items()):
        print(f"  {file}: {ok}/{total}")
    reasons: dict[str, int] = {}
    for entry in failures.values():
        reasons[entry["why"][:110]] = reasons.get(entry["why"][:110], 0) + 1
    for why, count in sorted(reasons.items(), key=lambda x: -x[1]):
        print(f"  {count:3d} x {why}")
    unknown = [n for n, e in failures.items() if e["reason"].startswith("not known")]
    print(
        f"  {len(unknown)} failure(s) without a known reason"
        + "".join(f"\n    {n}" for n in unknown)
    )


def ensure_tests_deps() -> None:
    """einops, which vLLM's test helpers import and the light install lacks."""
    if not (DEPS_DIR / "einops").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        subprocess.run([*pip, "--target", str(DEPS_DIR), "einops"], check=True)


if __name__ == "__main__":
    main()
