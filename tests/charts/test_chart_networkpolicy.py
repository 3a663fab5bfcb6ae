"""Only the gateway reaches engine pods and Redis.

Engine pods get their NetworkPolicy from the operator (one per pool, in the pool's namespace),
configured by the chart: the rendered operator env is parsed by the real OperatorSettings, the
operator's own builder makes the policy of a pool from an example, and the policy is checked
against the rendered gateway pods. The chart itself renders only the Redis policy.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from slotserve.operator.builders import build_deployment
from slotserve.operator.models import InferencePool
from slotserve.operator.network import build_network_policy
from slotserve.operator.settings import OperatorSettings
from tests.charts.chart_support import NAMESPACE, RELEASE, ROOT, Rendered, env_of, load_yaml

REDIS = f"{RELEASE}-slotserve-redis"
GATEWAY = f"{RELEASE}-slotserve-gateway"
OPERATOR = f"{RELEASE}-slotserve-operator"


def operator_settings(rendered: Rendered, monkeypatch) -> OperatorSettings:
    (container,) = rendered.get("Deployment", OPERATOR)["spec"]["template"]["spec"]["containers"]
    for name in [n for n in os.environ if n.startswith("SLOTSERVE_")]:
        monkeypatch.delenv(name)
    for name, var in env_of(container).items():
        if "value" in var:  # Secret references (the Redis password) are the cluster's to fill
            monkeypatch.setenv(name, var["value"])
    return OperatorSettings()


def engine_pool(example: str, namespace: str) -> InferencePool:
    body = load_yaml(ROOT / "examples" / example)
    body["metadata"]["namespace"] = namespace
    return InferencePool.from_body(body)


def pool_policy(rendered: Rendered, monkeypatch, example: str, namespace: str) -> dict[str, Any]:
    """The NetworkPolicy the operator installed by this render makes for a pool."""
    settings = operator_settings(rendered, monkeypatch)
    assert settings.network_policy
    return build_network_policy(
        engine_pool(example, namespace),
        gateway_namespace=settings.gateway_namespace,
        gateway_pod_labels=settings.gateway_pod_labels,
        scraper_peers=settings.scraper_peers,
    )


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


def gateway_labels(rendered: Rendered) -> dict[str, str]:
    return rendered.get("Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("example", ["smollm2-cpu.yaml", "llama-8b-gpu.yaml"])
@pytest.mark.parametrize("pool_namespace", [NAMESPACE, "team-x"])
def test_every_pool_admits_only_this_release_s_gateway(
    render, monkeypatch, example, pool_namespace
):
    rendered = render()
    policy = pool_policy(rendered, monkeypatch, example, pool_namespace)
    assert policy["metadata"]["namespace"] == pool_namespace  # wherever the pool lives
    deployment = build_deployment(engine_pool(example, pool_namespace), engine_image="e:1")
    template = deployment["spec"]["template"]
    assert matches(policy["spec"]["podSelector"], template["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    port_names = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    assert {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]} <= port_names

    gateway = gateway_labels(rendered)
    assert admits(policy, gateway, NAMESPACE, "http")
    # Another release's gateway, a random pod, the operator, Redis: all refused.
    assert not admits(policy, {**gateway, "app.kubernetes.io/instance": "other"}, NAMESPACE, "http")
    assert not admits(policy, {"app": "curl"}, NAMESPACE, "http")
    assert not admits(policy, {"app": "curl"}, pool_namespace, "http")
    for component in ("operator", "redis"):
        other = {**gateway, "app.kubernetes.io/component": component}
        assert not admits(policy, other, NAMESPACE, "http")
    # Pods with the gateway's labels elsewhere (e.g. in the pool's team namespace) are refused.
    assert not admits(policy, gateway, "elsewhere", "http")
    if pool_namespace != NAMESPACE:
        assert not admits(policy, gateway, pool_namespace, "http")


def test_extra_engine_ingress_lets_monitoring_scrape(render, monkeypatch):
    policy = pool_policy(render("servicemonitor.yaml"), monkeypatch, "smollm2-cpu.yaml", "ml")
    assert admits(policy, {"app": "prometheus"}, "monitoring", "http")
    assert not admits(policy, {"app": "prometheus"}, "default", "http")


def test_only_the_gateway_and_the_operator_reach_redis(render):
    rendered = render()
    policy = rendered.get("NetworkPolicy", REDIS)
    redis_pods = rendered.get("StatefulSet", REDIS)["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], redis_pods)
    assert admits(policy, gateway_labels(rendered), NAMESPACE, "redis")
    # The operator reads the admission state (status.admission, the built-in autoscaler).
    operator = rendered.get("Deployment", OPERATOR)["spec"]["template"]["metadata"]["labels"]
    assert admits(policy, operator, NAMESPACE, "redis")
    assert not admits(policy, {"app": "curl"}, NAMESPACE, "redis")
    engine = {**gateway_labels(rendered), "app.kubernetes.io/component": "engine"}
    assert not admits(policy, engine, NAMESPACE, "redis")
    assert not admits(policy, operator, "elsewhere", "redis")


def test_without_the_operator_only_the_gateway_reaches_redis(render):
    rendered = render(extra=["--set", "operator.enabled=false"])
    policy = rendered.get("NetworkPolicy", REDIS)
    operator = {**gateway_labels(rendered), "app.kubernetes.io/component": "operator"}
    assert not admits(policy, operator, NAMESPACE, "redis")
    assert admits(policy, gateway_labels(rendered), NAMESPACE, "redis")


def test_default_install_renders_every_network_policy(render, monkeypatch):
    rendered = render()
    # The chart's own: Redis. The engines' are the operator's, switched on by its settings.
    assert [p["metadata"]["name"] for p in rendered.of_kind("NetworkPolicy")] == [REDIS]
    assert operator_settings(rendered, monkeypatch).network_policy is True


def test_network_policies_can_be_turned_off(render, monkeypatch):
    rendered = render(extra=["--set", "networkPolicy.enabled=false"])
    assert not rendered.of_kind("NetworkPolicy")
    assert operator_settings(rendered, monkeypatch).network_policy is False


@pytest.mark.parametrize(
    ("values_files", "namespace_selector"),
    [
        (("servicemonitor.yaml",), {"any": True}),
        (("servicemonitor.yaml", "namespaced-rbac.yaml"), {"matchNames": ["team-a", "team-b"]}),
    ],
)
def test_pod_monitor_scrapes_operator_built_engines(render, values_files, namespace_selector):
    monitor = render(*values_files).get("PodMonitor", f"{RELEASE}-slotserve-engines")
    deployment = build_deployment(engine_pool("llama-8b-gpu.yaml", "team-a"), engine_image="e:1")
    template = deployment["spec"]["template"]
    assert matches(monitor["spec"]["selector"], template["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == namespace_selector
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_pod_monitor_is_optional(render):
    rendered = render("servicemonitor.yaml", extra=["--set", "serviceMonitor.engines=false"])
    assert rendered.of_kind("ServiceMonitor")
    assert not rendered.of_kind("PodMonitor")
