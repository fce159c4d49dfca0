"""What several vLLM test modules share: whether a cached vLLM release is there."""

import os

import pytest

from kvpool.specs.targets.vllm.releases import release_dir


def require_cached_release(version: str) -> None:
    """Skip (or fail, under ``KVPOOL_REQUIRE_VLLM=1``) unless release ``version`` is cached.

    CI fetches the releases its tests read (``.ci/run``: ci/fetch_vllm_releases.py),
    so there a missing one is an error, never a silent skip.
    """
    if (release_dir(version) / ".kvpool-complete").is_file():
        return
    reason = f"vLLM {version} is not in the kvpool cache (ci/fetch_vllm_releases.py {version})"
    if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVPOOL_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)
