"""bench/ is a package: its scripts share bench.lib and import no other script, nor tests/.

Each script still runs as ``python bench/NAME.py`` (a fresh interpreter whose path starts at
bench/, as a user runs it); ``slotserve bench NAME`` is tested in test_bench_cli.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def scripts() -> list[Path]:
    return sorted(path for path in BENCH.glob("*.py") if path.name != "__init__.py")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def path_changes(path: Path) -> list[str]:
    """``sys.path.insert(...)`` / ``append`` calls: a script that needs one imports by file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"insert", "append"}
            and ast.unparse(node.func.value) == "sys.path"
        ):
            found.append(ast.unparse(node))
    return found


def forbidden(name: str, script_names: set[str]) -> bool:
    top, _, rest = name.partition(".")
    if top in script_names or top in {"support", "tests", "lib", "engine_plots"}:
        return True  # a script, or a test helper, by bare name
    # Through the package, only the library may be imported.
    return top == "bench" and bool(rest) and not rest.startswith("lib")


def test_the_package_and_its_library_exist() -> None:
    assert (BENCH / "__init__.py").is_file()
    assert {"engine", "quality", "plots", "services"} <= {
        path.stem for path in (BENCH / "lib").glob("*.py")
    }
    assert len(scripts()) >= 10


@pytest.mark.parametrize(
    "path",
    [*scripts(), *sorted((BENCH / "lib").glob("*.py"))],
    ids=lambda path: str(path.relative_to(BENCH)),
)
def test_no_script_imports_another_script_or_the_tests(path: Path) -> None:
    script_names = {script.stem for script in scripts()}
    bad = [name for name in imported_modules(path) if forbidden(name, script_names)]
    assert bad == [], f"{path.name} imports scripts or test helpers: {bad}"
    assert path_changes(path) == [], f"{path.name} changes sys.path"


@pytest.mark.parametrize(
    "source",
    [
        "import engine_bench",
        "from quant_quality import score",
        "from bench.step_cost import interleaved_step_ms",
        "from support import RedisServer",
        "import tests.support",
        "from engine_plots import plot_decode",
    ],
)
def test_the_check_catches_each_spelling(source: str, tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    script_names = {script.stem for script in scripts()}
    assert any(forbidden(name, script_names) for name in imported_modules(path))


def test_the_check_sees_a_path_change(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text("import sys\nsys.path.insert(0, 'tests')\n")
    assert path_changes(path) == ["sys.path.insert(0, 'tests')"]


@pytest.mark.parametrize(
    "name", ["quant_bench", "gateway_bench", "fairness_bench", "quant_quality", "step_cost"]
)
def test_a_script_runs_from_its_own_folder(name: str) -> None:
    # As a user runs it: the interpreter's path starts at bench/, not at the checkout's root.
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
