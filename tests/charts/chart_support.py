"""Helpers of the Helm chart suite: paths, the rendered-objects wrapper, small lookups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "slotserve"
VALUES_DIR = Path(__file__).resolve().parent / "values"
ENSURE_TOOLS = ROOT / "scripts" / "ensure-tools.sh"
RELEASE = "demo"
NAMESPACE = "serving"
HELM_TIMEOUT_S = 60
GOOD_VALUES = sorted(p.name for p in VALUES_DIR.glob("*.yaml") if not p.name.startswith("bad-"))


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Rendered:
    """The objects of one `helm template` run, with lookups the tests need."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found = [
            obj
            for obj in self.of_kind(kind)
            if obj["metadata"]["name"] == name
            and (namespace is None or obj["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(obj["metadata"]["name"] == name for obj in self.of_kind(kind))


def template_args(values_files: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds"]
    for name in values_files:
        args += ["--values", str(VALUES_DIR / name)]
    return [*args, *extra]


def pod_specs(rendered: Rendered) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload and bare pod."""
    specs = []
    for obj in rendered.objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
            specs.append((name, obj["spec"]["template"]["spec"]))
        elif obj["kind"] == "Pod":
            specs.append((name, obj["spec"]))
    return specs


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())
