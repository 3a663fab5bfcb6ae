"""`helm lint --strict` with the real helm binary, for the defaults and every good values file."""

from __future__ import annotations

import re
import subprocess
import tarfile
import time

import pytest

from tests.charts.chart_support import CHART, ENSURE_TOOLS, GOOD_VALUES, VALUES_DIR


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


def test_ensure_tools_is_quick_and_quiet_when_cached(helm_bin):
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ENSURE_TOOLS)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""
    assert time.monotonic() - started < 5
    assert (helm_bin.parent / "kubectl").is_file()


def test_chart_refuses_kubernetes_older_than_it_supports(run_helm):
    base = ["template", "demo", str(CHART)]
    assert run_helm([*base, "--kube-version", "1.29.0"]).returncode == 0
    old = run_helm([*base, "--kube-version", "1.28.9"])
    assert old.returncode != 0
    assert "kubeVersion" in old.stderr or "incompatible" in old.stderr, old.stderr


def test_packaged_chart_renders_like_the_folder(run_helm, tmp_path):
    """`helm package` keeps every file the chart needs (.helmignore drops nothing vital)."""
    result = run_helm(["package", str(CHART), "--destination", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("slotserve-0.1.0.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for needed in (
        "slotserve/values.schema.json",
        "slotserve/crds/inferencepools.slotserve.dev.yaml",
        "slotserve/templates/NOTES.txt",
        "slotserve/templates/tests/test-gateway.yaml",
    ):
        assert needed in names
    packaged = run_helm(["template", "demo", str(archive), "--namespace", "serving"])
    assert packaged.returncode == 0, packaged.stderr
    folder = run_helm(["template", "demo", str(CHART), "--namespace", "serving"])
    # The generated Redis password is random in every render (no cluster to look it up in).
    password = re.compile(r'redis-password: "[^"]*"')
    assert password.sub("", packaged.stdout) == password.sub("", folder.stdout)
