"""Fetch vLLM releases' Python sources into kvpool's release cache, for CI.

Run with the CI venv's interpreter before kvpool is installed: it loads
``specs/targets/vllm/releases.py`` (standard library only) by path and calls its
``ensure_release`` for each version given (wheel downloaded with pip, its
``vllm/`` Python files kept in ``~/.cache/kvpool/vllm/X.Y.Z``, the wheel
deleted; a cached release is not fetched again).
"""

import importlib.util
import sys
import time
from pathlib import Path

RELEASES = Path(__file__).resolve().parents[1] / "specs" / "targets" / "vllm" / "releases.py"

spec = importlib.util.spec_from_file_location("kvpool_vllm_releases", RELEASES)
assert spec is not None and spec.loader is not None
releases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(releases)

for version in sys.argv[1:]:
    started = time.monotonic()
    where = releases.ensure_release(version)
    print(f"vLLM {version} sources in {where} ({time.monotonic() - started:.0f} s)")
