"""Getting a vLLM to check: the installed one, a user's class, or a named release.

Target strings (``kvpool check --target ...``):

* ``vllm``: the ``vllm`` package importable in this interpreter;
* ``vllm:package.module:Class``: a ``BlockPool`` subclass or fork with vLLM's
  constructor, checked with the installed vLLM's helper types;
* ``vllm==X.Y.Z``: a published release. Its wheel is downloaded once with
  ``pip download --no-deps`` into ``~/.cache/kvpool/vllm/X.Y.Z`` (the root
  ``~/.cache/kvpool`` is replaced by ``$KVPOOL_CACHE`` when set), only its
  Python sources are kept, and the check runs in a child interpreter that
  finds that tree first on ``sys.path``, on top of the dependencies installed
  for the current vLLM. Two vLLM versions cannot share one process.

Nothing here imports vLLM: the kvpool package does not depend on it.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

VLLM = "vllm"
RELEASE_PREFIX = "vllm=="
RELEASE_ENV = "KVPOOL_VLLM_RELEASE"
"""Set in the child interpreter that checks a release: the release it imports."""
CLASS_PREFIX = "vllm:"

KEPT_SUFFIXES = (".py", ".json", ".jinja")
"""The files of a wheel's ``vllm/`` tree that are kept: sources and small data
files read at import time. Compiled extensions and headers are dropped; the
block pool never loads them."""

OLDEST_RELEASE = (0, 8, 0)
"""The first release with ``vllm/v1/core/block_pool.py``."""

EXTRA_DEPENDENCIES_BEFORE = (0, 24, 0)
EXTRA_DEPENDENCIES = (
    "blake3==1.0.11",
    "diskcache==5.6.3",
    "fsspec==2026.9.0",
    "gguf==0.19.0",
    "jinja2==3.1.6",
    "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1",
    "markupsafe==3.0.4",
    "mistral-common==1.13.1",
    "pycountry==26.2.16",
    "pydantic-extra-types==2.11.1",
    "referencing==0.37.0",
    "rpds-py==2026.9.1",
    "setproctitle==1.3.8",
    "tiktoken==0.14.0",
)
"""Packages that releases before 0.24 import on the way to the block pool and
that vLLM 0.33 no longer needs. They are installed (``--no-deps``) into
``<cache>/_deps`` and put at the *end* of ``sys.path``, so whatever the
environment has installed wins."""


class ReleaseError(RuntimeError):
    """A release could not be downloaded, unpacked or run."""


# --------------------------------------------------------------------------
# Target strings
# --------------------------------------------------------------------------


def is_vllm_target(spec: str) -> bool:
    """Whether ``spec`` names a vLLM target (``vllm``, ``vllm:mod:Class``, ``vllm==X``)."""
    return spec == VLLM or spec.startswith((RELEASE_PREFIX, CLASS_PREFIX))


def release_of(spec: str) -> str | None:
    """The version ``vllm==X.Y.Z`` names, or None for any other target string."""
    if not spec.startswith(RELEASE_PREFIX):
        return None
    version = spec[len(RELEASE_PREFIX) :].strip()
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?([.\w+-]*)", version):
        raise ReleaseError(f"not a vLLM version: {version!r}")
    return version


def version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.10.1.1"`` -> ``(0, 10, 1)``: the release's first three numbers."""
    numbers = [int(n) for n in re.findall(r"\d+", version)[:3]]
    while len(numbers) < 3:
        numbers.append(0)
    return numbers[0], numbers[1], numbers[2]


# --------------------------------------------------------------------------
# Which semantics profile each release follows
# --------------------------------------------------------------------------


def profile_for_release(version: str) -> str:
    """The semantics profile (``kvpool.model.PROFILES``) a release is expected to follow.

    From docs/semantics.md: ``append`` up to 0.23.x, ``hashless-first`` from
    0.24.0, except 0.27.x (``hashless-first-append-uncached``, a bug fixed
    in 0.28.0).
    """
    v = version_tuple(version)
    if v < (0, 24, 0):
        return "append"
    if (0, 27, 0) <= v < (0, 28, 0):
        return "hashless-first-append-uncached"
    return "hashless-first"


def installed_version() -> str | None:
    """The version of the ``vllm`` this interpreter would import, without importing it.

    Read from ``vllm/_version.py`` next to the package that ``import vllm``
    would load, so a release put first on ``sys.path`` reports its own version.
    """
    try:
        spec = find_spec(VLLM)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        version_file = Path(location) / "_version.py"
        if version_file.is_file():
            found = re.search(
                r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                version_file.read_text(),
            )
            if found:
                return found.group(1)
    return None


def default_profile_for(spec: str) -> list[str] | None:
    """The profile a vLLM target string should be checked against by default.

    ``vllm==X`` gives release X's profile, ``vllm`` and ``vllm:mod:Class``
    the installed release's; any other target gives None (the kit's default).
    """
    version = release_of(spec)
    if version is None and is_vllm_target(spec):
        version = installed_version()
    return None if version is None else [profile_for_release(version)]


# --------------------------------------------------------------------------
# The release cache
# --------------------------------------------------------------------------


def cache_root() -> Path:
    """Where releases are kept: ``$KVPOOL_CACHE/vllm``, by default ``~/.cache/kvpool/vllm``."""
    root = os.environ.get("KVPOOL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "kvpool"
    return base / "vllm"


def release_dir(version: str) -> Path:
    """The directory whose ``vllm/`` subdirectory holds release ``version``'s sources."""
    return cache_root() / version


def _complete_marker(version: str) -> Path:
    return release_dir(version) / ".kvpool-complete"


def ensure_release(version: str, quiet: bool = True) -> Path:
    """Download and unpack release ``version`` unless it is cached; return its directory.

    The wheel is fetched with this interpreter's pip (``--no-deps
    --only-binary :all:``: the source distributions need a full build to
    produce metadata), its ``vllm/`` sources are unpacked into a temporary
    directory that is renamed into place, and the wheel is deleted.
    """
    target = release_dir(version)
    if _complete_marker(version).is_file():
        return target
    if version_tuple(version) < OLDEST_RELEASE:
        raise ReleaseError(f"vLLM {version} predates the v1 block pool (0.8.0)")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{version}-") as scratch:
        download = Path(scratch) / "wheel"
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            f"vllm=={version}",
            "-d",
            str(download),
        ]
        if quiet:
            command.append("-q")
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = sorted(download.glob("vllm-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ReleaseError(
                f"pip could not download the vLLM {version} wheel:\n{result.stderr.strip()}"
            )
        unpacked = Path(scratch) / "tree"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [
                name
                for name in wheel.namelist()
                if name.startswith("vllm/") and name.endswith(KEPT_SUFFIXES)
            ]
            wheel.extractall(unpacked, members=members)
        for wheel_file in wheels:
            wheel_file.unlink()
        if not (unpacked / "vllm" / "v1" / "core" / "block_pool.py").is_file():
            raise ReleaseError(f"vLLM {version} has no vllm/v1/core/block_pool.py")
        (unpacked / _complete_marker(version).name).write_text(version + "\n")
        if target.exists():
            shutil.rmtree(target)
        unpacked.rename(target)
    return target


# --------------------------------------------------------------------------
# Running a release in a child interpreter
# --------------------------------------------------------------------------


def dependencies_dir() -> Path:
    """Where ``EXTRA_DEPENDENCIES`` are installed."""
    return cache_root() / "_deps"


def ensure_dependencies(version: str) -> Path | None:
    """Install ``EXTRA_DEPENDENCIES`` once if release ``version`` needs them; their directory."""
    if version_tuple(version) >= EXTRA_DEPENDENCIES_BEFORE:
        return None
    target = dependencies_dir()
    marker = target / ".kvpool-complete"
    if marker.is_file():
        return target
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    result = subprocess.run(
        [*command, *EXTRA_DEPENDENCIES], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ReleaseError(
            f"pip could not install the dependencies of vLLM {version}:\n{result.stderr.strip()}"
        )
    marker.write_text("\n".join(EXTRA_DEPENDENCIES) + "\n")
    return target


def activate_release(version: str | None) -> None:
    """In a child interpreter: make release ``version`` importable (its tree is on PYTHONPATH).

    Appends the extra dependencies for releases before 0.24, runs the
    preloads old releases need, and lets 0.9.x register model configurations
    that the installed transformers already has.
    """
    if version is None:
        return
    if version_tuple(version) < EXTRA_DEPENDENCIES_BEFORE and dependencies_dir().is_dir():
        sys.path.append(str(dependencies_dir()))
    preload_for_release(version)


def release_environment(version: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child interpreter needs to import release ``version``.

    Release quirks (measured with torch 2.13 and vLLM 0.33's dependencies):
    0.10.x hashes with the built-in ``hash()`` unless told otherwise, so
    ``PYTHONHASHSEED`` is pinned for reproducible runs; the torch preload that
    0.8.x needs happens when the child starts (``kvpool.specs.cli.__main__``).
    """
    env = dict(os.environ if base is None else base)
    path = str(release_dir(version))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    env[RELEASE_ENV] = version
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return env


def run_check_in_release(spec: str, check_args: Sequence[str]) -> int:
    """Run ``kvpool check --target vllm==X <check_args>`` in a child that imports release X.

    ``check_args`` are the other options of ``kvpool check``; the default
    semantics profile is the release's own. Returns the child's exit code
    (2 if the release cannot be fetched).
    """
    version = release_of(spec)
    if version is None:
        raise ReleaseError(f"{spec!r} does not name a release (vllm==X.Y.Z)")
    try:
        ensure_release(version)
        ensure_dependencies(version)
    except ReleaseError as error:
        print(f"kvpool: {error}", file=sys.stderr)
        return 2
    args = list(check_args)
    if "--profile" not in args:
        args += ["--profile", profile_for_release(version)]
    command = [sys.executable, "-m", "kvpool.specs.cli", "check", "--target", spec]
    env = release_environment(version)
    env["KVPOOL_PROG"] = f"kvpool (vLLM {version})"
    return subprocess.run([*command, *args], env=env, check=False).returncode


def delegate_check(target: str, context: Any) -> int | None:
    """For ``kvpool check --target vllm==X``: run the check in a child, return its exit code.

    Returns None for any other target (the caller checks in-process). The
    child gets every option given to the ``kvpool check`` command whose
    (typer/click) ``context`` is passed, with ``--target vllm``.
    """
    try:
        version = release_of(target)
    except ReleaseError as error:
        print(f"kvpool: {error}", file=sys.stderr)
        return 2
    if version is None:
        return None
    if os.environ.get(RELEASE_ENV) == version == installed_version():
        return None  # this is the child: the release is the importable vllm
    return run_check_in_release(target, forwarded_options(context))


def forwarded_options(context: Any, drop: Sequence[str] = ("target",)) -> list[str]:
    """The options given on a command line, from its (typer/click) context, as argv again."""
    args: list[str] = []
    for param in context.command.params:
        if getattr(param, "param_type_name", "") != "option" or param.name in drop:
            continue
        value = context.params.get(param.name)
        source = context.get_parameter_source(param.name)
        if value is None or source is None or source.name == "DEFAULT":
            continue
        for item in value if param.multiple else [value]:
            if param.is_flag:
                args.append(param.opts[0] if item else param.secondary_opts[0])
            else:
                args += [param.opts[0], str(getattr(item, "value", item))]
    return args


def preload_for_release(version: str | None) -> None:
    """Imports that must precede ``import vllm`` for some releases.

    0.8.x imports ``torch._inductor`` pieces in an order torch 2.13 rejects
    unless ``torch._inductor.compile_fx`` is already loaded. 0.9.x registers
    model configurations (``aimv2``) that transformers 5 already has; the
    registration is told to accept that.
    """
    if version is None:
        return
    import importlib

    if version_tuple(version) < (0, 9, 0):
        importlib.import_module("torch._inductor.compile_fx")
    if version_tuple(version) < (0, 10, 0):
        auto_config = importlib.import_module("transformers").AutoConfig
        register = auto_config.register

        def tolerant(model_type: str, config: Any, exist_ok: bool = False) -> Any:
            return register(model_type, config, exist_ok=True)

        auto_config.register = staticmethod(tolerant)
