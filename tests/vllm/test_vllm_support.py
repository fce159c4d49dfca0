"""The parts of the vLLM support that need no vLLM: target strings, profiles, findings."""

import pytest

from kvpool.model import PROFILES
from kvpool.specs.pool.target import OPERATIONS
from kvpool.specs.targets.vllm.findings import KNOWN_FINDINGS, classify_divergence
from kvpool.specs.targets.vllm.pool import vllm_factory
from kvpool.specs.targets.vllm.releases import (
    ReleaseError,
    default_profile_for,
    is_vllm_target,
    profile_for_release,
    release_of,
)


@pytest.mark.parametrize(
    ("version", "profile"),
    [
        ("0.8.5", "append"),
        ("0.23.0", "append"),
        ("0.24.0", "hashless-first"),
        ("0.26.0", "hashless-first"),
        ("0.27.0", "hashless-first-append-uncached"),
        ("0.27.1", "hashless-first-append-uncached"),
        ("0.28.0", "hashless-first"),
        ("0.33.0", "hashless-first"),
    ],
)
def test_each_release_has_its_profile(version: str, profile: str) -> None:
    assert profile_for_release(version) == profile
    assert default_profile_for(f"vllm=={version}") == [profile]


def test_target_strings() -> None:
    assert is_vllm_target("vllm")
    assert is_vllm_target("vllm==0.24.0")
    assert is_vllm_target("vllm:pkg.mod:Pool")
    assert not is_vllm_target("impl")
    assert not is_vllm_target("vllm_fork.adapter:make_target")
    assert release_of("vllm==0.24.0") == "0.24.0"
    assert release_of("vllm") is None
    assert default_profile_for("impl") is None
    with pytest.raises(ReleaseError):
        release_of("vllm==latest")
    with pytest.raises(ValueError):
        vllm_factory("vllm:no_class_given")


def test_the_catalogue_is_consistent() -> None:
    for key, finding in KNOWN_FINDINGS.items():
        assert finding.key == key
        assert finding.operation in OPERATIONS
        assert finding.vllm_reactions
        assert finding.what_vllm_does


@pytest.mark.parametrize(
    ("failure", "known"),
    [
        (
            "get_new_blocks(-1): the model rejects it with InvalidBlockCount, "
            "the target accepts it",
            "negative-get",
        ),
        (
            "free_blocks([1, 1]): the model rejects it with OverFree, the target accepts it",
            "over-free",
        ),
        (
            "cache_full_blocks(tokens=[1, 2], blocks=[1], 0, 1, block_size=1, group=0, "
            "mask=None): the model rejects it with AlreadyCached, the target with "
            "VllmAssertionError",
            "recache",
        ),
    ],
)
def test_known_findings_are_recognised(failure: str, known: str) -> None:
    divergence = classify_divergence(failure)
    assert divergence is not None and divergence.finding is not None
    assert divergence.finding.key == known


def test_new_findings_and_other_failures_are_told_apart() -> None:
    new = classify_divergence(
        "touch([1]): the model rejects it with CachingDisabled, the target accepts it"
    )
    assert new is not None and new.finding is None
    assert new.operation == "touch" and new.vllm_reaction == "accepts"
    assert classify_divergence("get_num_free_blocks(): model returned 1, target returned 4") is None
    assert classify_divergence(None) is None


def test_profiles_named_here_exist() -> None:
    for version in ("0.8.5", "0.24.0", "0.27.0", "0.33.0"):
        assert profile_for_release(version) in PROFILES
