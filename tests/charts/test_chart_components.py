"""What each values choice installs: gateway, Redis modes, API keys, HPA, monitoring, test pod."""

from __future__ import annotations

import re

from slotserve.gateway.admission.tenants import Tenant
from slotserve.gateway.http.api_keys import parse_keys_file
from tests.charts.chart_support import RELEASE, ROOT, env_of, load_yaml

GATEWAY = f"{RELEASE}-slotserve-gateway"
OPERATOR = f"{RELEASE}-slotserve-operator"
REDIS = f"{RELEASE}-slotserve-redis"


def gateway_container(rendered):
    spec = rendered.get("Deployment", GATEWAY)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return container


def mounted_file(pod_spec, container, path):
    """(volume, key) that provides the file at ``path`` inside ``container``."""
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
            file_name = path[len(prefix) :]
            items = volume["secret"].get("items", [])
            key = next(i["key"] for i in items if i["path"] == file_name) if items else file_name
            return volume, key
    raise AssertionError(f"nothing mounted at {path}")


def test_defaults_install_two_gateways_a_pdb_and_bundled_redis(render):
    rendered = render()
    deployment = rendered.get("Deployment", GATEWAY)
    assert deployment["spec"]["replicas"] == 2
    assert rendered.get("PodDisruptionBudget", GATEWAY)["spec"]["maxUnavailable"] == 1
    assert not rendered.of_kind("HorizontalPodAutoscaler")
    assert not rendered.of_kind("ServiceMonitor")
    statefulset = rendered.get("StatefulSet", REDIS)
    assert statefulset["spec"]["replicas"] == 1
    assert "volumeClaimTemplates" not in statefulset["spec"]
    service = rendered.get("Service", REDIS)
    assert service["spec"]["ports"][0]["port"] == 6379
    env = env_of(gateway_container(rendered))
    # The bundled Redis requires a password (test_chart_security.py has the details).
    assert env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"] == (
        f"redis://:$(SLOTSERVE_REDIS_PASSWORD)@{REDIS}:6379/0"
    )
    assert env["SLOTSERVE_GATEWAY_DISCOVERY"]["value"] == "kubernetes"
    # No keys configured: no key file, the gateway accepts every caller.
    assert "SLOTSERVE_GATEWAY_API_KEYS_FILE" not in env


def test_gateway_serves_on_the_contract_port_with_probes(render):
    rendered = render()
    container = gateway_container(rendered)
    assert container["args"] == ["gateway", "--log-level", "INFO"]
    assert container["image"] == "ghcr.io/slotserve/gateway:0.1.0"
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("http", 8080)
    env = env_of(container)
    assert env["SLOTSERVE_GATEWAY_PORT"]["value"] == "8080"
    assert env["SLOTSERVE_GATEWAY_HOST"]["value"] == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    service = rendered.get("Service", GATEWAY)
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_operator_gets_engine_image_and_health_probe(render):
    rendered = render()
    spec = rendered.get("Deployment", OPERATOR)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["image"] == "ghcr.io/slotserve/operator:0.1.0"
    assert container["args"] == ["operator", "--log-level", "INFO"]
    env = env_of(container)
    assert env["SLOTSERVE_OPERATOR_ENGINE_IMAGE"]["value"] == "ghcr.io/slotserve/engine:0.1.0"
    assert env["SLOTSERVE_OPERATOR_HEALTH_PORT"]["value"] == "8080"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "SLOTSERVE_OPERATOR_PEERING_NAME" not in env  # one replica runs standalone


def test_operator_standbys_use_kopf_peering(render):
    rendered = render("operator-ha.yaml")
    deployment = rendered.get("Deployment", OPERATOR)
    assert deployment["spec"]["replicas"] == 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert env_of(container)["SLOTSERVE_OPERATOR_PEERING_NAME"]["value"] == OPERATOR


def test_external_redis_replaces_the_bundled_one(render):
    rendered = render("external-redis.yaml")
    assert not rendered.of_kind("StatefulSet")
    assert not rendered.has("Service", REDIS)
    assert not rendered.has("NetworkPolicy", REDIS)
    container = gateway_container(rendered)
    names = [var["name"] for var in container["env"]]
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert names.index("SLOTSERVE_REDIS_PASSWORD") < names.index("SLOTSERVE_GATEWAY_REDIS_URL")
    env = env_of(container)
    assert env["SLOTSERVE_REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "slotserve-redis", "key": "password"}
    }
    assert env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"] == (
        "rediss://:$(SLOTSERVE_REDIS_PASSWORD)@redis.example.internal:6380/2"
    )


def test_external_redis_without_password_is_used_verbatim(render):
    rendered = render(
        extra=[
            "--set",
            "redis.bundled.enabled=false",
            "--set",
            "redis.external.url=redis://shared-redis.cache:6379/3",
        ]
    )
    env = env_of(gateway_container(rendered))
    assert env["SLOTSERVE_GATEWAY_REDIS_URL"]["value"] == "redis://shared-redis.cache:6379/3"
    assert "SLOTSERVE_REDIS_PASSWORD" not in env


def test_api_keys_reach_the_gateway_and_the_test_pod_as_a_file(render):
    rendered = render("api-keys.yaml")
    secret = rendered.get("Secret", f"{RELEASE}-slotserve-api-keys")
    assert secret["stringData"]["api-keys"].split() == [
        "sk-team-a-0123456789",
        "sk-team-b-9876543210",
    ]
    deployment = rendered.get("Deployment", GATEWAY)
    pod_spec = deployment["spec"]["template"]["spec"]
    container = gateway_container(rendered)
    key_file = env_of(container)["SLOTSERVE_GATEWAY_API_KEYS_FILE"]["value"]
    volume, key = mounted_file(pod_spec, container, key_file)
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert key == "api-keys"
    # Changing the keys rolls the gateway pods.
    assert "checksum/api-keys" in deployment["spec"]["template"]["metadata"]["annotations"]
    (test_pod,) = rendered.of_kind("Pod")
    (curl,) = test_pod["spec"]["containers"]
    volume, key = mounted_file(test_pod["spec"], curl, "/etc/slotserve/api-keys/key")
    assert (volume["secret"]["secretName"], key) == (secret["metadata"]["name"], "api-keys")


def test_api_keys_with_tenants_render_as_the_gateway_reads_them(render):
    secret = render("api-keys-tenants.yaml").get("Secret", f"{RELEASE}-slotserve-api-keys")
    keys, tenants = parse_keys_file(secret["stringData"]["api-keys"], "secret")
    assert [(key.secret, key.tenant, key.levels) for key in keys] == [
        ("sk-legacy-0123456789", "default", range(1, 10)),
        ("sk-team-a-1", "team-a", range(1, 10)),
        ("sk-team-a-2", "team-a", range(5, 10)),
        ("sk-frozen", "frozen", range(1, 10)),
    ]
    assert tenants["team-a"] == Tenant(
        "team-a",
        weight=3,
        max_inflight=8,
        requests_per_minute=600,
        tokens_per_minute=10_000_000_000,  # the largest, exact (no float in between)
    )
    assert tenants["frozen"].has_zero_quota  # a quota of zero stays zero, not absent
    assert tenants["default"] == Tenant()


def test_existing_api_key_secret_is_mounted_not_created(render):
    rendered = render("operator-ha.yaml")
    # The only Secret is the bundled Redis's password: no API-key Secret of the chart's own.
    assert [s["metadata"]["name"] for s in rendered.of_kind("Secret")] == [REDIS]
    container = gateway_container(rendered)
    key_file = env_of(container)["SLOTSERVE_GATEWAY_API_KEYS_FILE"]["value"]
    pod_spec = rendered.get("Deployment", GATEWAY)["spec"]["template"]["spec"]
    volume, key = mounted_file(pod_spec, container, key_file)
    assert (volume["secret"]["secretName"], key) == ("gateway-keys", "keys.txt")
    assert rendered.get("Deployment", GATEWAY)["spec"]["replicas"] == 3


def test_redis_persistence_uses_a_claim_and_append_only_file(render):
    statefulset = render("api-keys.yaml").get("StatefulSet", REDIS)
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert "--appendonly" in container["args"]
    assert container["args"][container["args"].index("--appendonly") + 1] == "yes"
    volumes = {v["name"] for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert "data" not in volumes  # the claim, not an emptyDir, backs /data


def test_hpa_replaces_fixed_replicas(render):
    rendered = render("hpa.yaml")
    assert "replicas" not in rendered.get("Deployment", GATEWAY)["spec"]
    hpa = rendered.get("HorizontalPodAutoscaler", GATEWAY)
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": GATEWAY,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["target"]["averageUtilization"] == 60
    # CPU utilisation is relative to requests: the gateway must request CPU.
    assert gateway_container(rendered)["resources"]["requests"]["cpu"]


def test_service_monitor_scrapes_gateway_metrics(render):
    rendered = render("servicemonitor.yaml")
    monitor = rendered.get("ServiceMonitor", GATEWAY)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def test_helm_test_pod_checks_ready_and_models_through_the_service(render):
    rendered = render()
    (pod,) = rendered.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    script = container["args"][0]
    base = env_of(container)["GATEWAY"]["value"]
    assert base == f"http://{GATEWAY}:80"
    assert '"$GATEWAY/ready"' in script
    assert '"$GATEWAY/v1/models"' in script
    assert "--fail-with-body" in script  # a non-2xx answer fails the test pod
    # Every curl is bounded, so `helm test` cannot hang.
    assert len(re.findall(r"\bcurl\b", script)) == len(re.findall(r"--max-time \d+", script))


def test_names_follow_fullname_override(render):
    rendered = render(extra=["--set", "fullnameOverride=llm"])
    names = {obj["metadata"]["name"] for obj in rendered.objects if obj["kind"] != "Secret"}
    names.discard("inferencepools.slotserve.dev")
    assert names == {
        "llm-gateway",
        "llm-operator",
        "llm-redis",
        "llm-test",
    }


def test_notes_examples_exist():
    for name in ("smollm2-cpu.yaml", "llama-8b-gpu.yaml"):
        pool = load_yaml(ROOT / "examples" / name)
        assert pool["kind"] == "InferencePool"


def test_operator_can_run_elsewhere(render):
    rendered = render(extra=["--set", "operator.enabled=false"])
    components = {
        obj["metadata"]["labels"].get("app.kubernetes.io/component")
        for obj in rendered.objects
        if obj["kind"] != "CustomResourceDefinition"
    }
    assert "operator" not in components
    assert rendered.has("Deployment", GATEWAY)
    assert rendered.has("ClusterRole", GATEWAY)


def test_extra_env_reaches_the_containers(render):
    rendered = render(
        extra=[
            "--set-json",
            'gateway.extraEnv=[{"name":"SLOTSERVE_GATEWAY_DEFAULT_PRIORITY","value":"3"}]',
            "--set-json",
            'operator.extraEnv=[{"name":"SLOTSERVE_OPERATOR_PRIORITY","value":"100"}]',
        ]
    )
    assert env_of(gateway_container(rendered))["SLOTSERVE_GATEWAY_DEFAULT_PRIORITY"]["value"] == "3"
    (operator,) = rendered.get("Deployment", OPERATOR)["spec"]["template"]["spec"]["containers"]
    assert env_of(operator)["SLOTSERVE_OPERATOR_PRIORITY"]["value"] == "100"
