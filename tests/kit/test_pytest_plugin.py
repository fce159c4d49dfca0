"""The pytest plugin: ``--kvpool-target`` adds a conformance item to any suite."""

import pytest

pytest_plugins = ["pytester"]


def test_without_the_option_nothing_is_added(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_mine():\n    assert True\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_a_conforming_target_adds_one_passing_item(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_mine():\n    assert True\n")
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--kvpool-target=impl", "--kvpool-examples=20", "-v"
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*kvpool-conformance?impl? PASSED*"])


def test_a_diverging_target_fails_with_the_counterexample(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--kvpool-target=tests.kit.buggy_pool:WrongUsage",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*tests.kit.buggy_pool:WrongUsage: divergence*",
            "*Minimal failing program*",
            "*Where they part: step 1 of 1, get_usage*",
            "*the model returns 0.0, the target returned 0.25*",
            "*def test_kvpool_regression_*",
        ]
    )


def test_level_profile_and_vectors_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--kvpool-target=model",
        "--kvpool-level=2",
        "--kvpool-profile=append",
        "--kvpool-examples=10",
        "--kvpool-vectors",
    )
    result.assert_outcomes(passed=2)


def test_an_unknown_target_fails_cleanly(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("-p", "no:cacheprovider", "--kvpool-target=nosuchmodule:make")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cannot import 'nosuchmodule'*"])


def test_the_request_layer_conforming_target_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_mine():\n    assert True\n")
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--kvpool-layer=request",
        "--kvpool-target=impl",
        "--kvpool-examples=15",
        "--kvpool-vectors",
        "-v",
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*kvpool-vectors?impl? PASSED*"])


def test_a_diverging_manager_fails_with_the_counterexample(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        mymanager="""
from kvpool.specs.request.model_target import ModelManagerTarget


class ForgetsStats(ModelManagerTarget):
    def make_prefix_cache_stats(self):
        super().make_prefix_cache_stats()
        return None


def make(setup):
    return ForgetsStats(setup)
"""
    )
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--kvpool-layer=request", "--kvpool-target=mymanager:make"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*mymanager:make: divergence*",
            "*Where they part:*make_prefix_cache_stats*",
            "*def test_kvpool_request_regression_*",
        ]
    )


def test_the_v0_layer_has_no_vectors(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--kvpool-layer=v0",
        "--kvpool-target=model",
        "--kvpool-examples=5",
        "--kvpool-vectors",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the v0 layer has no conformance vectors*"])


def test_no_shrink_shows_the_program_as_found(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--kvpool-target=tests.kit.buggy_pool:WrongUsage",
        "--kvpool-no-shrink",
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*tests.kit.buggy_pool:WrongUsage: divergence*",
            "*Failing program, not shrunk*",
        ]
    )
    assert "Minimal failing program" not in result.stdout.str()
