"""Every layer through the same front door: the registry, ``check`` and ``kvpool check --layer``."""

import pytest
from typer.testing import CliRunner

from kvpool.model import PoolConfig
from kvpool.model.v0 import V0Config
from kvpool.specs import check
from kvpool.specs.cli import app
from kvpool.specs.pool.model_target import ModelTarget
from kvpool.specs.request.model_target import ModelManagerTarget
from kvpool.specs.request.target import ManagerSetup
from kvpool.specs.targets import LAYERS, TargetSpecError, resolve
from kvpool.specs.v0.model_target import ModelV0Target
from tests.v0.tiny_allocator import NoDeduplication


def pool_factory(config: PoolConfig) -> ModelTarget:
    return ModelTarget(config)


def manager_factory(setup: ManagerSetup) -> ModelManagerTarget:
    return ModelManagerTarget(setup)


def v0_factory(config: V0Config) -> ModelV0Target:
    return ModelV0Target(config)


def no_dedup_factory(config: V0Config) -> NoDeduplication:
    return NoDeduplication(config)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check", *args, "--hypothesis-profile", "ci"])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("layer", "factory"),
    [
        ("pool", "tests.kit.test_layers:pool_factory"),
        ("request", "tests.kit.test_layers:manager_factory"),
        ("v0", "tests.kit.test_layers:v0_factory"),
        ("events", "kvpool.specs.events.model_target:ReferenceConsumer"),
    ],
)
def test_a_module_factory_is_a_target_of_every_layer(layer: str, factory: str) -> None:
    descriptor = resolve(layer, factory)
    assert descriptor.layer == layer and descriptor.factory is not None
    report = check(layer, descriptor, max_examples=15, steps=10)
    assert report.conforms, report.failure
    assert report.examples_run >= 15


def test_the_v0_layer_runs_from_the_command_line_and_finds_a_planted_bug() -> None:
    code, output = invoke("--layer", "v0", "--examples", "20")
    assert code == 0 and "conforms" in output, output
    code, output = invoke(
        "--layer", "v0", "--target", "tests.kit.test_layers:no_dedup_factory", "--examples", "150"
    )
    assert code == 1, output
    assert "append_token_ids" in output


def test_the_request_layer_has_one_name_and_manager_still_works() -> None:
    for name in ("request", "manager"):
        code, output = invoke("--layer", name, "--examples", "10")
        assert code == 0 and "conforms" in output, output


@pytest.mark.parametrize(
    ("layer", "target"),
    [
        ("v0", "impl"),
        ("v0", "cmd:node pool.js"),
        ("request", "cmd:"),
        ("request", "vllm:pkg.mod"),
        ("request", "vllm==latest"),
        ("request", "nonsense"),
        ("request", ":factory"),
        ("request", "tests.kit.test_layers:"),
        ("pool", "nonsense"),
        ("pool", "no.such.module:factory"),
    ],
)
def test_an_unsupported_combination_exits_2_naming_what_is_supported(
    layer: str, target: str
) -> None:
    with pytest.raises(TargetSpecError):
        resolve(layer, target)
    code, output = invoke("--layer", layer, "--target", target)
    assert code == 2, output
    assert "Traceback" not in output


def test_options_that_do_not_fit_the_layer_exit_2() -> None:
    code, output = invoke("--layer", "v0", "--level", "2")
    assert code == 2 and "level" in output, output
    code, output = invoke("--layer", "v0", "--profile", "hashless-first")
    assert code == 2 and "discipline" in output, output
    code, output = invoke("--layer", "pool", "--profile", "no-such-profile")
    assert code == 2, output


def test_every_layer_resolves_the_model() -> None:
    for layer in LAYERS:
        descriptor = resolve(layer, "model")
        assert descriptor.factory is not None and not descriptor.in_child
        # The events layer's model is the reference consumer: scores, not states.
        assert ("scores" if layer == "events" else "snapshot") in descriptor.operations
