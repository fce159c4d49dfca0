"""vLLM is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_VLLM=1`` (CI sets it where vLLM is installed)."""

import importlib
import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def require_vllm() -> Iterator[None]:
    """Import vLLM's block pool once; skip (or fail, if required) when that is impossible."""
    try:
        importlib.import_module("vllm.v1.core.block_pool")
    except Exception as error:  # ImportError, or a dependency failing at import time
        reason = f"vLLM cannot be imported: {error!r}"
        if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_VLLM=1 to make this an error)")
    yield
