"""`helm lint --strict` with the real helm binary, for the defaults and every good values file."""

from __future__ import annotations

import pytest
from chart_support import CHART, GOOD_VALUES, VALUES_DIR


def test_helm_binary_is_real_helm(run_helm):
    result = run_helm(["version", "--short"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(("v3.", "v4.")), result.stdout


@pytest.mark.parametrize("values_file", [None, *GOOD_VALUES])
def test_lint_strict_passes(run_helm, values_file):
    args = ["lint", "--strict", str(CHART)]
    if values_file:
        args += ["--values", str(VALUES_DIR / values_file)]
    result = run_helm(args)
    assert result.returncode == 0, f"helm lint --strict failed:\n{result.stdout}\n{result.stderr}"
    assert "0 chart(s) failed" in result.stdout
    # --strict turns warnings into failures; the only note left is the optional icon.
    notes = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert all("icon is recommended" in line for line in notes), notes
