"""Finding the installed SGLang and the parts of its radix caches the adapter uses.

Nothing here imports SGLang when it is imported: kvpool does not depend on
it. ``load_sglang()`` imports it on first use (about 15 s on a CPU, almost
all of it torch and the model configurations SGLang registers) and checks
that the classes and parameters the adapter calls exist. Anything that goes
wrong (not installed, an import error, an API that drifted) is a
``TargetError`` with the reason: ``kvpool check`` exits 2, never 1.

The adapter was written against SGLang 0.5.23 (``TESTED_RELEASE``); another
release is tried, and refused only if its API differs.
"""

import importlib
import logging
import os
import re
import warnings
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from kvpool.specs.errors import TargetError

SGLANG = "sglang"
TESTED_RELEASE = "0.5.23"
RELEASE_PREFIX = "sglang=="

INSTALL_HINT = (
    "pip install 'kvpool[sglang]', or on a CPU-only machine the light install of "
    "docs/sglang-conformance.md (ci/sglang-light-requirements.txt)"
)


@dataclass(frozen=True)
class SglangApi:
    """The parts of SGLang the adapter uses."""

    version: str
    radix_cache: type[Any]
    unified_radix_cache: type[Any]
    radix_key: type[Any]
    cache_init_params: type[Any]
    insert_params: type[Any]
    match_prefix_params: type[Any]
    evict_params: type[Any]
    dec_lock_ref_params: type[Any]
    full_component: Any
    radix_module: ModuleType
    events_module: ModuleType


def installed_version() -> str | None:
    """The installed SGLang's version, read from its metadata without importing it."""
    try:
        return metadata.version(SGLANG)
    except metadata.PackageNotFoundError:
        return None


def release_of(spec: str) -> str | None:
    """The version ``sglang==X.Y.Z`` names, or None for any other target string."""
    if not spec.startswith(RELEASE_PREFIX):
        return None
    version = spec[len(RELEASE_PREFIX) :].strip()
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?([.\w+-]*)", version):
        raise ValueError(f"not an SGLang version: {version!r}")
    return version


_LOADED: SglangApi | None = None


def load_sglang() -> SglangApi:
    """Import SGLang's radix caches once; TargetError (with the reason) if that fails."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    version = installed_version()
    if version is None:
        raise TargetError(f"SGLang is not installed: {INSTALL_HINT}")
    # A Rust core that panics prints a backtrace unless told not to (the
    # adapter turns the panic into a rejection; the backtrace is noise).
    os.environ.setdefault("RUST_BACKTRACE", "0")
    try:
        # Importing SGLang imports torchvision, quantization layers and (if it is
        # installed) parts of vLLM, which warn about the missing GPU: noise here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            try:
                radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
                base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
                params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
                unified = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
                components = importlib.import_module(
                    "sglang.srt.mem_cache.unified_cache.components"
                )
                events = importlib.import_module("sglang.srt.mem_cache.events")
            finally:
                logging.disable(logging.NOTSET)
    except Exception as error:
        raise TargetError(
            f"SGLang {version} cannot be imported here: {error!r} ({INSTALL_HINT})"
        ) from None
    try:
        api = SglangApi(
            version=version,
            radix_cache=radix.RadixCache,
            unified_radix_cache=unified.UnifiedRadixCache,
            radix_key=radix.RadixKey,
            cache_init_params=params.CacheInitParams,
            insert_params=base.InsertParams,
            match_prefix_params=base.MatchPrefixParams,
            evict_params=base.EvictParams,
            dec_lock_ref_params=base.DecLockRefParams,
            full_component=components.ComponentType.FULL,
            radix_module=radix,
            events_module=events,
        )
        fields = set(getattr(params.CacheInitParams, "__dataclass_fields__", {}))
        needed = {"tree_components", "tree_core_backend", "eviction_policy", "page_size"}
        if not needed <= fields:
            raise AttributeError(f"CacheInitParams lacks {sorted(needed - fields)}")
        if not hasattr(radix, "time"):
            raise AttributeError("radix_cache no longer reads the clock through `time`")
    except AttributeError as error:
        raise TargetError(
            f"SGLang {version}'s radix cache API differs from {TESTED_RELEASE}'s, which the "
            f"adapter speaks: {error}"
        ) from None
    _LOADED = api
    return api


def unavailable_reason() -> str | None:
    """Why SGLang's radix caches cannot be loaded here, or None if they can."""
    try:
        load_sglang()
    except TargetError as error:
        return str(error)
    return None


def native_hash_reason() -> str | None:
    """Why the C++ hash extension (events of the legacy and Python cores) cannot load, or None.

    SGLang compiles it with torch's ``cpp_extension`` on first use (g++,
    ninja and OpenSSL headers needed; seconds, cached under
    ``$TORCH_EXTENSIONS_DIR``). The Rust core hashes natively.
    """
    try:
        native = importlib.import_module("sglang.srt.mem_cache.cpp_utils.native_hash")
        native._load_native_hash_module()
    except Exception as error:
        cause = error.__cause__ or error
        return (
            f"SGLang's C++ page-hash extension cannot be built here ({cause!r}); it needs "
            "g++, ninja-build and libssl-dev. Check with events off, or the Rust core"
        )
    return None
