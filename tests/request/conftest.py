"""vLLM is optional for the request layer's comparisons with it: a module that compares
asks for ``require_vllm_manager`` and skips, visibly, without vLLM, or fails when
``KVPOOL_REQUIRE_VLLM=1`` (CI sets it where vLLM is installed)."""

import importlib
import os

import pytest


@pytest.fixture(scope="session")
def require_vllm_manager() -> None:
    """Import vLLM's KV cache manager once; skip (or fail, if required) when that is impossible."""
    try:
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception as error:  # ImportError, or a dependency failing at import time
        reason = f"vLLM's KVCacheManager cannot be imported: {error!r}"
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_VLLM=1 to make this an error)")
