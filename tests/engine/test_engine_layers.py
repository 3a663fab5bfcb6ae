"""The engine's layers: the core (scheduler, cache, runner, sampling) never reaches for HTTP.

``slotserve.engine.core`` must run in a benchmark or a test with no web server around it, so no
module under ``core/`` may import ``slotserve.engine.http`` or aiohttp, nor may the settings
module that every core module reads. Imports are read from the source (``ast``), including those
inside functions and ``TYPE_CHECKING`` blocks, so a lazy import cannot hide one.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine" / "slotserve" / "engine"
CORE = ENGINE / "core"
# Modules the core imports from outside core/: they must keep to the same rule.
SHARED = [ENGINE / "settings.py"]
FORBIDDEN = ("slotserve.engine.http", "aiohttp")


def imported_modules(source: str, package: str) -> list[str]:
    """Every module ``source`` imports, by absolute name (relative ones resolved in ``package``)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            # `from slotserve.engine import http` names the module in the alias.
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def forbidden_imports(source: str, package: str) -> list[str]:
    return [
        name
        for name in imported_modules(source, package)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    ]


def package_of(path: Path) -> str:
    return ".".join(path.relative_to(ENGINE.parents[1]).parent.parts)


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py")) + SHARED


def test_the_core_layer_has_modules_to_check():
    names = {path.name for path in core_modules()}
    assert {"scheduler.py", "kv_cache.py", "runner.py", "sampling.py", "engine.py"} <= names
    assert package_of(CORE / "scheduler.py") == "slotserve.engine.core"


@pytest.mark.parametrize("path", core_modules(), ids=lambda path: path.name)
def test_core_never_imports_the_http_layer(path: Path):
    found = forbidden_imports(path.read_text(), package_of(path))
    assert found == [], f"{path.relative_to(ENGINE)} imports the HTTP layer: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "import aiohttp",
        "import aiohttp.web",
        "from aiohttp import web",
        "from slotserve.engine.http.server import serve",
        "from slotserve.engine import http",
        "from ..http import tool_calls",
        "from ..http.choices import Choices",
        "def f():\n    from slotserve.engine.http import choices",
        "if TYPE_CHECKING:\n    from slotserve.engine.http.http_state import ServerState",
    ],
)
def test_the_check_catches_each_spelling(source: str):
    assert forbidden_imports(source, "slotserve.engine.core")


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "from slotserve.engine.core.params import SamplingParams",
        "from . import scheduler",
        "from slotserve.engine.settings import EngineSettings",
        "import httpx",
    ],
)
def test_the_check_lets_core_imports_through(source: str):
    assert forbidden_imports(source, "slotserve.engine.core") == []


def test_importing_the_engine_sets_no_openmp_environment():
    # The entry point applies it (the CLI, a benchmark, conftest); an import must not.
    code = (
        "import os, slotserve.engine.core.model.runner, slotserve.engine.http.server\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))\n"
        "from slotserve.engine.core.openmp import apply_openmp_environment\n"
        "import torch\n"
        "print(apply_openmp_environment())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # Nothing set by importing; and once torch is loaded it is too late, so nothing is added.
    assert out.stdout.splitlines() == ["None None", "{}"]


def test_the_cli_applies_the_openmp_environment_before_torch_loads():
    code = (
        "import os, sys\n"
        "from slotserve.engine import cli\n"
        "import slotserve.engine.http.server as server\n"
        "async def serve(settings, provider):\n"
        "    print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, flush=True)\n"
        "    return 0\n"
        "server.serve = serve\n"
        "cli.main(['--model', 'smollm2'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ACTIVE False"]
