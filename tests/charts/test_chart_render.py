"""`helm template` output is valid Kubernetes and hardened, with defaults and every values file."""

from __future__ import annotations

import re

import jsonschema
import kubernetes_validate
import pytest

from tests.charts.chart_support import GOOD_VALUES, NAMESPACE, pod_specs

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the helm binary's own.
KUBE_VERSIONS = ["1.29.0", "1.35.0"]

# Kinds that are not built into Kubernetes: kubernetes-validate has no schema for them, so each
# is checked against the minimal shape the chart relies on (the real CRDs are far larger).
MONITOR_ENDPOINTS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["port"],
        "properties": {
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
        },
    },
}


def _monitor_shape(endpoints_key: str, namespace_selector: dict) -> dict:
    """A ServiceMonitor or PodMonitor: the same spec, with its endpoints under another key."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints_key],
                "properties": {
                    "selector": {
                        "type": "object",
                        "properties": {"matchLabels": {"type": "object"}},
                    },
                    "namespaceSelector": namespace_selector,
                    endpoints_key: MONITOR_ENDPOINTS,
                },
            },
        },
    }


MATCH_NAMES = {"type": "array", "items": {"type": "string"}}
CUSTOM_KIND_SHAPES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _monitor_shape(
        "endpoints", {"type": "object", "properties": {"matchNames": MATCH_NAMES}}
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _monitor_shape(
        "podMetricsEndpoints",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {"any": {"type": "boolean"}, "matchNames": MATCH_NAMES},
        },
    ),
}

ALL_RENDERS = [(), *((name,) for name in GOOD_VALUES)]


def _id(values_files: tuple[str, ...]) -> str:
    return "+".join(values_files) or "defaults"


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=_id)
def test_every_object_passes_strict_kubernetes_validation(render, values_files):
    rendered = render(*values_files)
    assert len(rendered.objects) >= 10
    for obj in rendered.objects:
        key = (obj["apiVersion"], obj["kind"])
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if key in CUSTOM_KIND_SHAPES:
            jsonschema.validate(obj, CUSTOM_KIND_SHAPES[key])
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} is invalid for Kubernetes {version}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{name}: {key} is neither built into Kubernetes nor a known CRD")


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=_id)
def test_every_pod_is_hardened(render, values_files):
    specs = pod_specs(render(*values_files))
    assert specs
    for name, spec in specs:
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, name
        assert pod_sc["runAsUser"] > 0, name
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"] + spec.get("initContainers", []):
            where = f"{name} container {container['name']}"
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=_id)
def test_selectors_match_their_pods(render, values_files):
    """Services, PDBs, HPAs and NetworkPolicies point at pods this chart (or the operator) makes."""
    rendered = render(*values_files)
    pod_labels = {
        obj["metadata"]["name"]: obj["spec"]["template"]["metadata"]["labels"]
        for obj in rendered.objects
        if obj["kind"] in {"Deployment", "StatefulSet"}
    }

    def selects_some_workload(selector: dict[str, str]) -> bool:
        return any(selector.items() <= labels.items() for labels in pod_labels.values())

    for workload in rendered.of_kind("Deployment") + rendered.of_kind("StatefulSet"):
        assert (
            workload["spec"]["selector"]["matchLabels"].items()
            <= pod_labels[workload["metadata"]["name"]].items()
        )
    for service in rendered.of_kind("Service"):
        assert selects_some_workload(service["spec"]["selector"]), service["metadata"]["name"]
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        assert selects_some_workload(pdb["spec"]["selector"]["matchLabels"])
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert rendered.has(target["kind"], target["name"])
    for monitor in rendered.of_kind("ServiceMonitor"):
        services = [
            s
            for s in rendered.of_kind("Service")
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert len(services) == 1
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


def test_every_object_has_the_standard_labels(render):
    for obj in render().objects:
        if obj["kind"] == "CustomResourceDefinition":
            continue
        labels = obj["metadata"]["labels"]
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert labels["app.kubernetes.io/name"] == "slotserve", where
        assert labels["app.kubernetes.io/instance"] == "demo", where
        assert labels["app.kubernetes.io/managed-by"] == "Helm", where
        assert labels["app.kubernetes.io/part-of"] == "slotserve", where
        assert labels["app.kubernetes.io/component"], where
        assert labels["helm.sh/chart"] == "slotserve-0.1.0", where


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=_id)
def test_every_long_running_container_is_sized_probed_and_pinned(render, values_files):
    for name, spec in pod_specs(render(*values_files)):
        for container in spec["containers"]:
            where = f"{name} container {container['name']}"
            image = container["image"]
            assert re.fullmatch(r"[^:@\s]+(:\d+)?/[^:@\s]+:[\w][\w.-]*", image), where
            assert not image.endswith(":latest"), where
            if name.startswith("Pod/"):  # the helm test pod runs once
                continue
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert "memory" in resources["limits"], where
            assert "readinessProbe" in container, where
            assert "livenessProbe" in container, where
