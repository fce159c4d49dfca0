"""``pip install kvpool`` (no extras) is enough for ``kvpool check``: no mypy, CrossHair or z3.

The runtime dependencies are what the check needs; the development tools are
in the ``dev`` extra (which CI installs: the README's test command) and
CrossHair in ``contracts``. The second test runs ``kvpool check`` in an
interpreter where importing any development tool fails, as it would where
they are not installed.
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVELOPMENT_TOOLS = ("mypy", "crosshair", "z3", "pytest", "ruff", "redis", "mkdocs")


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _names(requirements: object) -> set[str]:
    assert isinstance(requirements, list)
    return {str(r).split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_the_runtime_dependencies_hold_no_development_tool() -> None:
    runtime = _names(_project()["dependencies"])
    assert runtime == {"hypothesis", "typer", "rich", "jsonschema", "mypy_extensions"}
    extras = _project()["optional-dependencies"]
    assert isinstance(extras, dict)
    assert {"pytest", "mypy", "crosshair-tool"} <= _names(extras["dev"])
    assert _names(extras["contracts"]) == {"crosshair-tool"}


BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {DEVELOPMENT_TOOLS!r}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, Missing())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
sys.argv = ["kvpool", *sys.argv[1:]]
from kvpool.specs.cli import main
main()
"""


@pytest.mark.parametrize("layer", ["pool", "request", "v0", "events", "radix"])
def test_kvpool_check_runs_without_any_development_tool(tmp_path: Path, layer: str) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-c", BLOCKER, "check", "--layer", layer),
            *("--examples", "20", "--hypothesis-profile", "ci"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "conforms" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
