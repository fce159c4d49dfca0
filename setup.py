"""The build: kvpool.impl compiled with mypyc when this machine can, pure Python otherwise.

Everything else about the package is in pyproject.toml. ``pip install .`` runs
this; with a C compiler and Python's headers it compiles the modules of
``impl/`` (listed in ``COMPILED``) with mypyc, next to their ``.py`` sources;
without them, or when compiling fails, it prints one line and installs the
pure-Python impl, which behaves the same (``kvpool.impl.COMPILED`` says which
one was loaded; ``kvpool check`` prints it). Editable installs
(``pip install -e``) and ``KVPOOL_PURE=1`` always get the pure-Python impl:
developers edit and debug the sources they run.

mypy derives a module's name from its path; ``impl/`` installs as
``kvpool.impl`` (package-dir in pyproject.toml), so the sources are staged
under ``build/mypyc-src/kvpool/`` first.
"""

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = [
    "block",
    "free_queue",
    "pool",
    "single_type",
    "manager",
    "eagle",
    "geometry",
    "mamba_align",
    "mamba_reserve",
    "mamba_fine",
    "mamba_fine_reserve",
    "retention",
    "external",
    "coordinator",
    "align_dcp",
    "hisparse_layout",
    "hisparse_groups",
    "hisparse",
    "hisparse_view",
]
"""The modules of impl/ mypyc compiles (``__init__`` stays Python: it reports the build)."""

HERE = Path(__file__).resolve().parent
STAGE = Path("build") / "mypyc-src"


def say(line: str) -> None:
    print(f"kvpool: {line}", file=sys.stderr, flush=True)


def why_pure() -> str | None:
    """Why this build cannot compile impl/ (None: it can try)."""
    if os.environ.get("KVPOOL_PURE"):
        return "KVPOOL_PURE is set"
    if "editable_wheel" in sys.argv:
        return None if os.environ.get("KVPOOL_COMPILE_EDITABLE") else "editable install"
    if sys.implementation.name != "cpython":
        return f"mypyc needs CPython, not {sys.implementation.name}"
    # The compiler setuptools would run: $CC if set, else the one Python was built with.
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler}) found"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "Python's C headers (Python.h) are missing"
    return None


def staged_sources() -> list[str]:
    """impl/ and model/ copied under build/mypyc-src/kvpool/, so mypy names them kvpool.*."""
    for package in ("impl", "model"):
        target = STAGE / "kvpool" / package
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(HERE / package, target, ignore=shutil.ignore_patterns("__pycache__"))
    return [str(STAGE / "kvpool" / "impl" / f"{name}.py") for name in COMPILED]


BUILDS = {"bdist_wheel", "build", "build_ext", "install", "editable_wheel"}
"""The commands that build; pip also runs this file for its requirements and metadata."""


def ext_modules() -> list[object]:
    if not BUILDS.intersection(sys.argv[1:]):
        return []  # nothing is built in this run: no mypy, no message
    reason = why_pure()
    if reason is None:
        try:
            from mypyc.build import mypycify

            os.environ["MYPYPATH"] = str(STAGE)
            # --no-site-packages: an installed (older) kvpool must not stand in for the sources.
            flags = ["--explicit-package-bases", "--no-site-packages"]
            return list(mypycify([*flags, *staged_sources()], opt_level="3"))
        except (Exception, SystemExit) as failure:  # mypyc reports its errors by exiting
            reason = f"mypyc failed ({failure!r})"
    if reason != "editable install":
        say(f"installing the pure-Python kvpool.impl (not compiled: {reason})")
    return []


class OptionalBuildExt(build_ext):
    """build_ext that falls back to the pure-Python impl when the C build fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as failure:
            # No half-compiled impl: a shim without its shared library would not import.
            for extension in self.extensions:
                Path(self.get_ext_fullpath(extension.name)).unlink(missing_ok=True)
            self.extensions = []
            say(f"installing the pure-Python kvpool.impl (not compiled: {failure})")


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
