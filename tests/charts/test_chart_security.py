"""Secure defaults of the chart: Redis password, policy settings, graceful gateway rollouts.

Each weaker choice (no Redis password, hostPath allowed) takes an explicit value that
values.yaml documents; these tests pin the defaults and what each value turns into.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import re

import pytest

from slotserve.operator.settings import OperatorSettings
from tests.charts.chart_support import CHART, RELEASE, ROOT, env_of, template_args

GATEWAY = f"{RELEASE}-slotserve-gateway"
OPERATOR = f"{RELEASE}-slotserve-operator"
REDIS = f"{RELEASE}-slotserve-redis"


def _pod_security():
    """The Pod Security Standards checker of the operator suite (one implementation)."""
    path = ROOT / "tests" / "operator" / "pod_security.py"
    spec = importlib.util.spec_from_file_location("pod_security", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def container(rendered, kind: str, name: str) -> dict:
    (found,) = rendered.get(kind, name)["spec"]["template"]["spec"]["containers"]
    return found


def secret_ref(var: dict) -> tuple[str, str]:
    ref = var["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_default_install_generates_a_redis_password_and_everyone_uses_it(render):
    rendered = render()
    secret = rendered.get("Secret", REDIS)
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)  # URL-safe as it is
    # Redis requires it (from the Secret, also for its own probes) ...
    redis_env = env_of(container(rendered, "StatefulSet", REDIS))
    assert secret_ref(redis_env["REDIS_PASSWORD"]) == (REDIS, "redis-password")
    assert secret_ref(redis_env["REDISCLI_AUTH"]) == (REDIS, "redis-password")
    assert "requirepass" in " ".join(container(rendered, "StatefulSet", REDIS)["command"])
    # ... and the gateway sends it: the URL takes it from the variable defined before it.
    gateway = container(rendered, "Deployment", GATEWAY)
    env = env_of(gateway)
    assert secret_ref(env["SLOTSERVE_REDIS_PASSWORD"]) == (REDIS, "redis-password")
    names = [var["name"] for var in gateway["env"]]
    assert names.index("SLOTSERVE_REDIS_PASSWORD") < names.index("SLOTSERVE_GATEWAY_REDIS_URL")
    assert ":$(SLOTSERVE_REDIS_PASSWORD)@" in env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"]
    # The operator reads the same Redis (status.admission, autoscaling): same Secret, same URL.
    operator = container(rendered, "Deployment", OPERATOR)
    operator_env = env_of(operator)
    assert secret_ref(operator_env["SLOTSERVE_REDIS_PASSWORD"]) == (REDIS, "redis-password")
    names = [var["name"] for var in operator["env"]]
    assert names.index("SLOTSERVE_REDIS_PASSWORD") < names.index("SLOTSERVE_OPERATOR_REDIS_URL")
    assert (
        operator_env["SLOTSERVE_OPERATOR_REDIS_URL"]["value"]
        == env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"]
    )


def test_the_generated_password_survives_upgrades():
    """On upgrade the Secret the cluster holds is read back (lookup) instead of a new one."""
    template = (CHART / "templates" / "redis-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert 'index $existing.data "redis-password" | b64dec' in template
    assert "randAlphaNum 32" in template


def test_an_existing_password_secret_replaces_the_generated_one(render):
    rendered = render(
        extra=[
            "--set",
            "redis.bundled.auth.existingSecret=my-redis",
            "--set",
            "redis.bundled.auth.existingSecretPasswordKey=pw",
        ]
    )
    assert not rendered.has("Secret", REDIS)
    assert secret_ref(env_of(container(rendered, "StatefulSet", REDIS))["REDIS_PASSWORD"]) == (
        "my-redis",
        "pw",
    )
    gateway_env = env_of(container(rendered, "Deployment", GATEWAY))
    assert secret_ref(gateway_env["SLOTSERVE_REDIS_PASSWORD"]) == ("my-redis", "pw")


def test_no_password_takes_an_explicit_documented_value(render):
    values = (CHART / "values.yaml").read_text()
    assert re.search(
        r"# auth: .*\n\s+auth:\n\s+# enabled: require the password.*\n(\s+#.*\n)*\s+enabled: true",
        values,
    )
    rendered = render(extra=["--set", "redis.bundled.auth.enabled=false"])
    assert not rendered.of_kind("Secret")
    env = env_of(container(rendered, "Deployment", GATEWAY))
    assert env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"] == f"redis://{REDIS}:6379/0"
    assert "SLOTSERVE_REDIS_PASSWORD" not in env


def test_external_redis_url_with_credentials_comes_from_a_secret(render):
    rendered = render("external-redis-url-secret.yaml")
    assert not rendered.of_kind("StatefulSet") and not rendered.of_kind("Secret")
    env = env_of(container(rendered, "Deployment", GATEWAY))
    assert secret_ref(env["SLOTSERVE_GATEWAY_REDIS_URL"]) == ("slotserve-redis-url", "url")
    assert "SLOTSERVE_REDIS_PASSWORD" not in env
    operator_env = env_of(container(rendered, "Deployment", OPERATOR))
    assert secret_ref(operator_env["SLOTSERVE_OPERATOR_REDIS_URL"]) == (
        "slotserve-redis-url",
        "url",
    )


def operator_settings(rendered, monkeypatch) -> OperatorSettings:
    for name in [n for n in os.environ if n.startswith("SLOTSERVE_")]:
        monkeypatch.delenv(name)
    for name, var in env_of(container(rendered, "Deployment", OPERATOR)).items():
        if "value" in var:  # Secret references are the cluster's to fill
            monkeypatch.setenv(name, var["value"])
    return OperatorSettings()


def test_operator_policy_defaults_are_the_safe_ones(render, monkeypatch):
    settings = operator_settings(render(), monkeypatch)
    assert settings.allow_host_path is False
    assert settings.allowed_images == [] and settings.allowed_service_accounts == []
    # The multi-tenant preset: the built-in env list only, and no scheduling beyond the
    # platform's own GPU nodes; the operator's own defaults say the same.
    assert settings.policy() == OperatorSettings().policy()
    assert settings.allowed_env == [] and settings.allowed_priority_classes == []
    assert settings.allowed_keda_server_addresses == []
    assert [(t.key, t.effect) for t in settings.allowed_tolerations] == [
        ("nvidia.com/gpu", "NoSchedule")
    ]
    assert settings.allowed_node_selector_keys == [
        "nvidia.com/gpu.present",
        "nvidia.com/gpu.product",
    ]
    assert settings.engine_egress is False and settings.hub_endpoint == ""
    assert settings.network_policy is True
    assert settings.gateway_namespace == "serving"
    assert settings.resync_seconds == 300
    values = (CHART / "values.yaml").read_text()
    assert re.search(r"# allowHostPath: .*\n(\s+#.*\n)*\s+allowHostPath: false", values)


def test_policy_values_reach_the_operator(render, monkeypatch):
    rendered = render(
        extra=[
            "--set",
            "policy.allowHostPath=true",
            "--set",
            "policy.allowedImages={ghcr.io/slotserve/*,registry.internal/ml/*}",
            "--set",
            "policy.allowedServiceAccounts={*/slotserve-engine}",
            "--set",
            "operator.resyncSeconds=60",
            "--set",
            "policy.allowedEnv={CC,NCCL_DEBUG}",
            "--set",
            "policy.allowedPriorityClasses={inference-*}",
            "--set-json",
            'policy.allowedTolerations=[{"key":"pool.example/*"},{"key":"spot","effect":"NoSchedule"}]',
            "--set",
            "policy.allowedNodeSelectorKeys={topology.kubernetes.io/zone}",
            "--set",
            "policy.allowedKedaServerAddresses={http://prometheus.monitoring:9090}",
            "--set",
            "engine.hubEndpoint=http://hub.mirror:8080",
            "--set",
            "networkPolicy.engineEgress.enabled=true",
            "--set-json",
            'networkPolicy.engineEgress.modelHub=[{"to":[{"ipBlock":{"cidr":"10.20.0.0/16"}}]}]',
        ]
    )
    settings = operator_settings(rendered, monkeypatch)
    assert settings.allow_host_path is True
    assert settings.allowed_images == ["ghcr.io/slotserve/*", "registry.internal/ml/*"]
    assert settings.allowed_service_accounts == ["*/slotserve-engine"]
    assert settings.resync_seconds == 60
    assert settings.allowed_env == ["CC", "NCCL_DEBUG"]
    assert settings.allowed_priority_classes == ["inference-*"]
    assert [(t.key, t.effect) for t in settings.allowed_tolerations] == [
        ("pool.example/*", None),
        ("spot", "NoSchedule"),
    ]
    assert settings.allowed_node_selector_keys == ["topology.kubernetes.io/zone"]
    assert settings.allowed_keda_server_addresses == ["http://prometheus.monitoring:9090"]
    assert settings.hub_endpoint == "http://hub.mirror:8080"
    dns, hub = settings.engine_egress_rules() or []
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert hub == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}


@pytest.mark.parametrize(
    ("set_value", "where"),
    [
        ("policy.allowedEnv={A=B}", "/policy/allowedEnv/0"),
        (
            "policy.allowedKedaServerAddresses={prometheus:9090}",
            "/policy/allowedKedaServerAddresses/0",
        ),
        ("engine.hubEndpoint=hub.mirror", "/engine/hubEndpoint"),
    ],
)
def test_bad_policy_values_are_refused_by_the_schema(run_helm, set_value, where):
    result = run_helm(template_args([], ["--set", set_value]))
    assert result.returncode != 0 and where in result.stderr, result.stderr


def test_gateway_rollouts_let_streams_finish(render):
    rendered = render(
        extra=[
            "--set",
            "gateway.preStopSleepSeconds=15",
            "--set",
            "gateway.drainTimeoutSeconds=600",
        ]
    )
    pod = rendered.get("Deployment", GATEWAY)["spec"]["template"]["spec"]
    gateway = container(rendered, "Deployment", GATEWAY)
    assert gateway["lifecycle"]["preStop"] == {"sleep": {"seconds": 15}}
    assert env_of(gateway)["SLOTSERVE_GATEWAY_SHUTDOWN_TIMEOUT_SECONDS"]["value"] == "600"
    # Kubernetes never SIGKILLs a gateway that is still within preStop + drain.
    assert pod["terminationGracePeriodSeconds"] == 15 + 600 + 10
    defaults = render().get("Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert defaults["terminationGracePeriodSeconds"] == 10 + 300 + 10


@pytest.mark.parametrize("values_files", [(), ("external-redis.yaml",), ("api-keys.yaml",)])
def test_chart_pods_pass_the_restricted_pod_security_standard(render, values_files):
    checker = _pod_security()
    for obj in render(*values_files).objects:
        if obj["kind"] in {"Deployment", "StatefulSet"}:
            template = obj["spec"]["template"]
            annotations = template["metadata"].get("annotations") or {}
            assert checker.restricted_violations(template["spec"], annotations) == [], obj["kind"]
        elif obj["kind"] == "Pod":
            assert checker.restricted_violations(obj["spec"]) == []
