"""``kvpool check --layer manager``."""

from typer.testing import CliRunner

from kvpool.specs.cli import app


def test_the_impl_manager_conforms_from_the_command_line() -> None:
    args = ["check", "--layer", "manager", "--target", "impl", "--examples", "20"]
    result = CliRunner().invoke(app, [*args, "--hypothesis-profile", "ci"])
    assert result.exit_code == 0, result.output
    assert "conforms" in result.output


def test_unknown_layers_and_targets_are_errors() -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["check", "--layer", "scheduler"]).exit_code == 2
    assert runner.invoke(app, ["check", "--layer", "manager", "--target", "cmd:x"]).exit_code == 2


def test_level_2_of_the_manager_layer_runs_and_is_reported() -> None:
    args = ["check", "--layer", "manager", "--level", "2", "--examples", "20", "--format", "json"]
    result = CliRunner().invoke(app, [*args, "--hypothesis-profile", "ci"])
    assert result.exit_code == 0, result.output
    assert '"level": 2' in result.output
