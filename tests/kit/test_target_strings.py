"""``--target module:factory`` finds a module in the working directory, as ``python -m`` would."""

from pathlib import Path

from tests.kit.helpers import assert_no_traceback, run_kvpool

OWN_POOL = """
from kvpool.specs.targets.impl.pool import ImplTarget

make = ImplTarget
"""


def test_a_module_in_the_working_directory_is_a_target(tmp_path: Path) -> None:
    (tmp_path / "my_pool_here.py").write_text(OWN_POOL)
    result = run_kvpool(
        "check",
        "--target",
        "my_pool_here:make",
        "--examples",
        "5",
        cwd=tmp_path,
        env={"PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "conforms" in result.stdout


def test_an_import_error_inside_the_module_is_not_masked(tmp_path: Path) -> None:
    (tmp_path / "broken_pool_here.py").write_text("import no_such_dependency_kvpool\n")
    result = run_kvpool("check", "--target", "broken_pool_here:make", cwd=tmp_path)
    assert result.returncode == 2
    assert "no_such_dependency_kvpool" in result.stdout + result.stderr
    assert_no_traceback(result)
