"""Dynamo is optional: its tests skip, visibly, without it, and fail without it when
``KVPOOL_REQUIRE_DYNAMO=1`` (``.ci/run`` sets it, installing ci/dynamo-light-requirements.txt)."""

import os
from collections.abc import Iterator

import pytest

from kvpool.specs.targets.dynamo.radix_tree import unavailable_reason


@pytest.fixture(scope="session")
def require_dynamo() -> Iterator[None]:
    """Import Dynamo's router index once; skip (or fail, if required) when that is impossible."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("KVPOOL_REQUIRE_DYNAMO") == "1":
            pytest.fail(f"KVPOOL_REQUIRE_DYNAMO=1 but {reason}", pytrace=False)
        pytest.skip(f"{reason} (set KVPOOL_REQUIRE_DYNAMO=1 to make this an error)")
    yield
