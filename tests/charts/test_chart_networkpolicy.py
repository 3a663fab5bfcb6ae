"""Only the gateway reaches engine pods and Redis, matched against what the operator builds."""

from __future__ import annotations

from typing import Any

import pytest
from chart_support import NAMESPACE, RELEASE, ROOT, load_yaml
from slotserve.operator.builders import build_deployment
from slotserve.operator.models import InferencePool

ENGINES = f"{RELEASE}-slotserve-engines"
REDIS = f"{RELEASE}-slotserve-redis"
GATEWAY = f"{RELEASE}-slotserve-gateway"


def engine_pod(example: str, namespace: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(pod labels, engine container) of a pool the operator would create from an example."""
    body = load_yaml(ROOT / "examples" / example)
    body["metadata"]["namespace"] = namespace
    deployment = build_deployment(InferencePool.from_body(body), engine_image="engine:test")
    template = deployment["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]["containers"][0]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are used here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def admits(policy: dict[str, Any], labels: dict[str, str], namespace: str, port: Any) -> bool:
    """Whether an ingress rule of ``policy`` lets a pod (labels, namespace) in on ``port``."""
    policy_namespace = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule["from"]:
            if "podSelector" not in peer and "namespaceSelector" not in peer:
                continue
            if "namespaceSelector" in peer:
                ns_labels = {"kubernetes.io/metadata.name": namespace}
                namespace_ok = matches(peer["namespaceSelector"], ns_labels)
            else:
                namespace_ok = namespace == policy_namespace
            pod_ok = matches(peer.get("podSelector", {}), labels)
            if namespace_ok and pod_ok:
                return True
    return False


def gateway_labels(rendered) -> dict[str, str]:
    return rendered.get("Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("example", ["smollm2-cpu.yaml", "llama-8b-gpu.yaml"])
def test_engine_policy_selects_operator_built_engine_pods(render, example):
    rendered = render()
    policy = rendered.get("NetworkPolicy", ENGINES)
    labels, container = engine_pod(example, NAMESPACE)
    assert matches(policy["spec"]["podSelector"], labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    # The policy names the engine port by the name the operator gives it.
    port_names = {p["name"] for p in container["ports"]}
    assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} <= port_names


def test_only_this_gateway_reaches_engines(render):
    rendered = render()
    policy = rendered.get("NetworkPolicy", ENGINES)
    gateway = gateway_labels(rendered)
    assert admits(policy, gateway, NAMESPACE, "http")
    # Another release's gateway, a random pod, the operator, Redis: all refused.
    assert not admits(policy, {**gateway, "app.kubernetes.io/instance": "other"}, NAMESPACE, "http")
    assert not admits(policy, {"app": "curl"}, NAMESPACE, "http")
    for component in ("operator", "redis"):
        other = {**gateway, "app.kubernetes.io/component": component}
        assert not admits(policy, other, NAMESPACE, "http")
    # The gateway from another namespace with the same labels is refused too.
    assert not admits(policy, gateway, "elsewhere", "http")


def test_only_the_gateway_reaches_redis(render):
    rendered = render()
    policy = rendered.get("NetworkPolicy", REDIS)
    redis_pods = rendered.get("StatefulSet", REDIS)["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], redis_pods)
    assert admits(policy, gateway_labels(rendered), NAMESPACE, "redis")
    operator = {**gateway_labels(rendered), "app.kubernetes.io/component": "operator"}
    assert not admits(policy, operator, NAMESPACE, "redis")
    assert not admits(policy, {"app": "curl"}, NAMESPACE, "redis")


def test_engine_policies_follow_watched_namespaces(render):
    rendered = render("namespaced-rbac.yaml")
    policies = [p for p in rendered.of_kind("NetworkPolicy") if p["metadata"]["name"] == ENGINES]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    gateway = gateway_labels(rendered)
    for policy in policies:
        labels, _ = engine_pod("smollm2-cpu.yaml", policy["metadata"]["namespace"])
        assert matches(policy["spec"]["podSelector"], labels)
        # The gateway lives in the release namespace, not in the engines' namespace.
        assert admits(policy, gateway, NAMESPACE, "http")
        assert not admits(policy, gateway, policy["metadata"]["namespace"], "http")


def test_extra_engine_ingress_lets_monitoring_scrape(render):
    policy = render("servicemonitor.yaml").get("NetworkPolicy", ENGINES)
    assert admits(policy, {"app": "prometheus"}, "monitoring", "http")
    assert not admits(policy, {"app": "prometheus"}, "default", "http")


def test_network_policies_can_be_turned_off(render):
    rendered = render(extra=["--set", "networkPolicy.enabled=false"])
    assert not rendered.of_kind("NetworkPolicy")


@pytest.mark.parametrize(
    ("values_files", "namespace_selector"),
    [
        (("servicemonitor.yaml",), {"any": True}),
        (("servicemonitor.yaml", "namespaced-rbac.yaml"), {"matchNames": ["team-a", "team-b"]}),
    ],
)
def test_pod_monitor_scrapes_operator_built_engines(render, values_files, namespace_selector):
    monitor = render(*values_files).get("PodMonitor", ENGINES)
    labels, container = engine_pod("llama-8b-gpu.yaml", "team-a")
    assert matches(monitor["spec"]["selector"], labels)
    assert monitor["spec"]["namespaceSelector"] == namespace_selector
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"


def test_pod_monitor_is_optional(render):
    rendered = render("servicemonitor.yaml", extra=["--set", "serviceMonitor.engines=false"])
    assert rendered.of_kind("ServiceMonitor")
    assert not rendered.of_kind("PodMonitor")
