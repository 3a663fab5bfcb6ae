"""Fixtures of the Helm chart suite: the real helm binary (fetched once) and cached renders."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml

from slotserve.settings import CommonSettings
from tests.charts.chart_support import (
    ENSURE_TOOLS,
    HELM_TIMEOUT_S,
    HelmResult,
    Rendered,
    template_args,
)


def _helm_path() -> Path:
    return CommonSettings().home / "tools" / "helm"


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """The real helm binary; fetched by scripts/ensure-tools.sh when missing (make test does it)."""
    helm = _helm_path()
    if os.access(helm, os.X_OK):
        return helm
    why = ""
    try:
        proc = subprocess.run(
            ["bash", str(ENSURE_TOOLS)], capture_output=True, text=True, timeout=240, check=False
        )
        why = f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    except subprocess.TimeoutExpired:
        why = "it ran for more than 240 s"
    if not os.access(helm, os.X_OK):
        pytest.fail(
            f"the chart tests need the real helm binary at {helm}; scripts/ensure-tools.sh "
            f"could not fetch it ({why})",
            pytrace=False,
        )
    return helm


@pytest.fixture(scope="session")
def run_helm(helm_bin: Path) -> Callable[[Sequence[str]], HelmResult]:
    """Run helm with the given arguments (offline; no cluster is contacted)."""

    def run(args: Sequence[str]) -> HelmResult:
        env = {**os.environ, "HELM_CACHE_HOME": str(_helm_path().parent / "helm-cache")}
        proc = subprocess.run(
            [str(helm_bin), *args],
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
            env=env,
        )
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def render(run_helm: Callable[[Sequence[str]], HelmResult]) -> Callable[..., Rendered]:
    """`helm template --include-crds` with values files from tests/charts/values; cached."""
    cache: dict[tuple[tuple[str, ...], tuple[str, ...]], Rendered] = {}

    def do_render(*values_files: str, extra: Sequence[str] = ()) -> Rendered:
        key = (tuple(values_files), tuple(extra))
        if key not in cache:
            result = run_helm(template_args(values_files, extra))
            assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
            objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
            cache[key] = Rendered(objects)
        return cache[key]

    return do_render
