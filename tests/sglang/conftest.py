"""SGLang is optional: these tests skip, visibly, without it, and fail without it
when ``KVPOOL_REQUIRE_SGLANG=1`` (CI sets it where SGLang is installed)."""

import os
from collections.abc import Iterator

import pytest


def _unavailable(reason: str) -> None:
    if os.environ.get("KVPOOL_REQUIRE_SGLANG") == "1":
        pytest.fail(f"KVPOOL_REQUIRE_SGLANG=1 but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set KVPOOL_REQUIRE_SGLANG=1 to make this an error)")


@pytest.fixture(scope="session")
def require_sglang() -> Iterator[None]:
    """Import SGLang's radix caches once; skip (or fail, if required) when that is impossible."""
    from kvpool.specs.targets.sglang.loading import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        _unavailable(reason)
    yield


@pytest.fixture(scope="session")
def require_native_hash(require_sglang: None) -> Iterator[None]:
    """The C++ page-hash extension the legacy and Python cores need for events (built once)."""
    from kvpool.specs.targets.sglang.loading import native_hash_reason

    reason = native_hash_reason()
    if reason is not None:
        _unavailable(reason)
    yield
