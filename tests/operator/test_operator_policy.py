"""The operator's policy, the engines' NetworkPolicy and drift detection, as pure functions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from slotserve.operator import builders
from slotserve.operator.drift import in_sync
from slotserve.operator.models import InferencePool
from slotserve.operator.network import build_network_policy
from slotserve.operator.policy import (
    DEFAULT_ALLOWED_ENV,
    ModelClaim,
    Policy,
    image_allowed,
    model_name_winner,
    normalize_image,
    service_account_allowed,
)
from slotserve.operator.settings import DEFAULT_DNS_PEERS, OperatorSettings
from tests.operator.pod_security import restricted_violations

IMAGE = "ghcr.io/slotserve/engine:0.1.0"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GATEWAY_LABELS = {"app.kubernetes.io/component": "gateway", "app.kubernetes.io/instance": "r"}


def from_env_text(**values: Any) -> OperatorSettings:
    """Settings given as the environment gives them: lists and objects as text, which the
    settings parse (their declared types are the parsed ones)."""
    return OperatorSettings(**values)


def make_pool(namespace: str = "ml", source: Any = None, **engine: Any) -> InferencePool:
    spec = {"model": {"name": "m", "source": source or {"builtin": "smollm2"}}, "engine": engine}
    return InferencePool.from_body(
        {"metadata": {"name": "chat", "namespace": namespace}, "spec": spec}
    )


def reason(policy: Policy, pool: InferencePool) -> str | None:
    problem = policy.check(pool)
    return problem.reason if problem else None


# --- policy ---------------------------------------------------------------------------------


def test_host_path_is_refused_unless_allowed():
    pool = make_pool(source={"hostPath": {"path": "/srv/models"}})
    assert reason(Policy(engine_image=IMAGE), pool) == "HostPathNotAllowed"
    assert reason(Policy(engine_image=IMAGE, allow_host_path=True), pool) is None
    assert reason(Policy(engine_image=IMAGE), make_pool()) is None


@pytest.mark.parametrize(
    ("image", "normalized"),
    [
        ("nginx", "docker.io/library/nginx"),
        ("team/app:1", "docker.io/team/app:1"),
        ("ghcr.io/slotserve/engine:0.1.0", "ghcr.io/slotserve/engine:0.1.0"),
        ("localhost/engine", "localhost/engine"),
        ("registry:5000/engine@sha256:ab", "registry:5000/engine@sha256:ab"),
    ],
)
def test_images_are_matched_by_their_full_reference(image: str, normalized: str):
    assert normalize_image(image) == normalized


def test_image_allow_list():
    patterns = ["ghcr.io/slotserve/*", "registry.internal/ml/engine:*"]
    assert image_allowed("ghcr.io/slotserve/engine:0.2.0", patterns)
    assert image_allowed("registry.internal/ml/engine:7", patterns)
    assert not image_allowed("ghcr.io/slotserve-evil/engine:1", patterns)
    assert not image_allowed("registry.internal/ml/other:7", patterns)
    # A registry left out is Docker Hub: "docker.io/library/*" patterns cannot be dodged.
    assert not image_allowed("slotserve/engine", ["slotserve/*"])
    assert image_allowed("slotserve/engine", ["docker.io/slotserve/*"])

    policy = Policy(engine_image=IMAGE, allowed_images=("ghcr.io/slotserve/*",))
    assert reason(policy, make_pool()) is None  # the operator's default image
    assert reason(policy, make_pool(image="docker.io/evil/miner:1")) == "ImageNotAllowed"
    assert reason(Policy(engine_image=IMAGE), make_pool(image="evil/miner")) is None  # no list


def test_settings_refuse_a_default_image_outside_the_allow_list():
    with pytest.raises(ValidationError, match="not in allowed_images"):
        OperatorSettings(engine_image="quay.io/x/engine:1", allowed_images=["ghcr.io/slotserve/*"])


def test_service_account_allow_list():
    assert service_account_allowed("ml", "engine", ["engine"])
    assert service_account_allowed("ml", "engine", ["ml/*"])
    assert not service_account_allowed("ops", "engine", ["ml/*"])
    policy = Policy(engine_image=IMAGE, allowed_service_accounts=("ml/slotserve-*",))
    assert reason(policy, make_pool(serviceAccountName="slotserve-engine")) is None
    assert reason(policy, make_pool(serviceAccountName="admin")) == "ServiceAccountNotAllowed"
    assert reason(policy, make_pool("ops", serviceAccountName="slotserve-x")) is not None
    assert reason(policy, make_pool()) is None  # no ServiceAccount named: always fine


def test_annotations_that_lift_confinement_are_refused():
    key = "container.apparmor.security.beta.kubernetes.io/engine"
    pool = make_pool(podAnnotations={key: "unconfined"})
    assert reason(Policy(engine_image=IMAGE), pool) == "PodAnnotationNotAllowed"
    assert reason(Policy(engine_image=IMAGE), make_pool(podAnnotations={"team": "a"})) is None


# Issue 27: each of these passed the old deny-list (LD_*, PYTHONPATH/HOME/STARTUP/USERBASE/
# EXECUTABLE) and ran the pool author's code, leaked the Hub token, or moved a cache the engine
# loads code from; with the pool's env winning over the operator's, even the operator's own
# TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR could be pointed at the pool's volume.
ISSUE_27_ENV_HOLES = {
    "SLOTSERVE_HOME": "/models",  # the engine loads /models/kernels/qgemm-<key>.so
    "CC": "/models/bin/x",  # run at every engine start (the compiler version probe)
    "CPATH": "/models/include",  # a planted <omp.h> in the kernels' compile
    "C_INCLUDE_PATH": "/models/include",
    "PYTHONPYCACHEPREFIX": "/models/pyc",  # planted .pyc files run, even with DONTWRITEBYTECODE
    "LIBRARY_PATH": "/models/lib",
    "COMPILER_PATH": "/models/bin",
    "GCC_EXEC_PREFIX": "/models/gcc/",
    "TORCHINDUCTOR_CACHE_DIR": "/models/inductor",
    "TRITON_CACHE_DIR": "/models/triton",
    "HF_ENDPOINT": "https://collector.example",  # huggingface_hub sends HF_TOKEN there
    "LD_PRELOAD": "/models/x.so",
    "PYTHONPATH": "/models/py",
}


@pytest.mark.parametrize(("name", "value"), sorted(ISSUE_27_ENV_HOLES.items()))
def test_every_env_hole_of_issue_27_is_refused_naming_the_variable(name: str, value: str):
    pool = make_pool(env=[{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": name, "value": value}])
    problem = Policy(engine_image=IMAGE).check(pool)
    assert problem is not None and problem.reason == "EnvNotAllowed"
    assert f"engine.env sets {name}:" in problem.message


def test_env_is_an_allow_list_the_platform_extends():
    assert reason(Policy(engine_image=IMAGE), make_pool(env=[{"name": "HF_HUB_OFFLINE"}])) is None
    # A name nobody listed anywhere is refused too: that is what an allow-list is for.
    unheard_of = make_pool(env=[{"name": "SOME_FUTURE_LOADER_PATH", "value": "/models"}])
    assert reason(Policy(engine_image=IMAGE), unheard_of) == "EnvNotAllowed"
    widened = from_env_text(allowed_env="SOME_FUTURE_LOADER_PATH, CC").policy()
    assert reason(widened, unheard_of) is None
    assert reason(widened, make_pool(env=[{"name": "CC", "value": "gcc"}])) is None
    assert reason(widened, make_pool(env=[{"name": "CPATH", "value": "/x"}])) == "EnvNotAllowed"
    # Every default name is harmless by itself: none names a file, a program or a host.
    assert not {"LD_PRELOAD", "PYTHONPATH", "CC", "HF_ENDPOINT"} & DEFAULT_ALLOWED_ENV


def test_the_operator_s_own_variables_can_never_be_allowed():
    with pytest.raises(ValidationError, match="HOME are set by the operator"):
        from_env_text(allowed_env=["HOME"])
    with pytest.raises(ValidationError, match="not an environment variable name"):
        from_env_text(allowed_env=["A=B"])


# --- scheduling -----------------------------------------------------------------------------


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        ({"tolerations": [GPU_TOLERATION]}, None),  # the platform's own GPU nodes
        ({"nodeSelector": {"nvidia.com/gpu.present": "true"}}, None),
        (
            {
                "tolerations": [
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                ]
            },
            "TolerationNotAllowed",
        ),
        ({"tolerations": [{"operator": "Exists"}]}, "TolerationNotAllowed"),  # every taint
        # The GPU taint with every effect (NoExecute too) is more than the rule allows.
        (
            {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
            "TolerationNotAllowed",
        ),
        ({"tolerations": [{**GPU_TOLERATION, "key": "dedicated"}]}, "TolerationNotAllowed"),
        ({"nodeSelector": {"kubernetes.io/hostname": "node-7"}}, "NodeSelectorNotAllowed"),
        ({"nodeSelector": {"team-b.example/dedicated": "true"}}, "NodeSelectorNotAllowed"),
        ({"priorityClassName": "system-node-critical"}, "PriorityClassNotAllowed"),
        ({"priorityClassName": "low"}, "PriorityClassNotAllowed"),
    ],
)
def test_the_default_settings_allow_no_scheduling_beyond_the_platform_s_own(
    engine: dict[str, Any], expected: str | None
):
    policy = OperatorSettings().policy()  # the defaults: the chart's multi-tenant preset
    assert reason(policy, make_pool(**engine)) == expected


def test_scheduling_allow_lists_take_globs():
    policy = from_env_text(
        allowed_priority_classes="inference-*",
        allowed_tolerations='[{"key": "pool.example/*"}, {"key": "spot", "effect": "NoSchedule"}]',
        allowed_node_selector_keys="topology.kubernetes.io/*",
    ).policy()
    ok = make_pool(
        priorityClassName="inference-low",
        tolerations=[
            {"key": "pool.example/a100", "operator": "Exists", "effect": "NoExecute"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        ],
        nodeSelector={"topology.kubernetes.io/zone": "z1"},
    )
    assert reason(policy, ok) is None
    assert reason(policy, make_pool(priorityClassName="batch")) == "PriorityClassNotAllowed"
    spot_all_effects = make_pool(tolerations=[{"key": "spot", "operator": "Exists"}])
    assert reason(policy, spot_all_effects) == "TolerationNotAllowed"
    # A single-tenant cluster allows everything with "*".
    anything = from_env_text(
        allowed_priority_classes="*",
        allowed_tolerations='[{"key": "*"}]',
        allowed_node_selector_keys="*",
    ).policy()
    everywhere = make_pool(
        priorityClassName="system-node-critical",
        tolerations=[{"operator": "Exists"}],
        nodeSelector={"kubernetes.io/hostname": "cp-1"},
    )
    assert reason(anything, everywhere) is None


def keda_pool(address: str) -> InferencePool:
    return InferencePool.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {
                "model": {"name": "m", "source": {"builtin": "smollm2"}},
                "autoscaling": {
                    "provider": "keda",
                    "maxReplicas": 2,
                    "keda": {"serverAddress": address},
                },
            },
        }
    )


def test_keda_server_addresses_are_an_exact_allow_list():
    prometheus = "http://prometheus.monitoring:9090"
    assert reason(Policy(engine_image=IMAGE), keda_pool(prometheus)) == "KedaServerNotAllowed"
    policy = from_env_text(allowed_keda_server_addresses=prometheus).policy()
    assert reason(policy, keda_pool(prometheus)) is None
    assert reason(policy, keda_pool(prometheus + "/")) is None
    for elsewhere in (
        f"{prometheus}@collector.example",
        "http://prometheus.monitoring:9091",
        "http://169.254.169.254/latest",
    ):
        assert reason(policy, keda_pool(elsewhere)) == "KedaServerNotAllowed", elsewhere
    assert (
        reason(
            from_env_text(allowed_keda_server_addresses="*").policy(),
            keda_pool("http://anywhere:1"),
        )
        is None
    )


def test_the_examples_pass_the_default_policy():
    policy = OperatorSettings().policy()
    for pool in example_pools():
        assert policy.check(pool) is None, pool.metadata.name


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_OPERATOR_ALLOWED_IMAGES", "ghcr.io/slotserve/*, quay.io/ml/*")
    monkeypatch.setenv("SLOTSERVE_OPERATOR_GATEWAY_POD_LABELS", '{"app": "gw"}')
    monkeypatch.setenv("SLOTSERVE_OPERATOR_SCRAPER_PEERS", '[{"podSelector": {}}]')
    settings = OperatorSettings()
    assert settings.allowed_images == ["ghcr.io/slotserve/*", "quay.io/ml/*"]
    assert settings.gateway_pod_labels == {"app": "gw"}
    assert settings.scraper_peers == [{"podSelector": {}}]
    assert settings.allow_host_path is False and settings.network_policy is True
    assert settings.resync_seconds == 300
    # Empty values mean empty lists: nothing allowed beyond the built-in env list.
    for name in ("ALLOWED_TOLERATIONS", "ALLOWED_NODE_SELECTOR_KEYS", "ENGINE_EGRESS_DNS_PEERS"):
        monkeypatch.setenv(f"SLOTSERVE_OPERATOR_{name}", "")
    settings = OperatorSettings()
    assert settings.allowed_tolerations == [] and settings.allowed_node_selector_keys == []
    assert settings.engine_egress_dns_peers == []
    monkeypatch.setenv("SLOTSERVE_OPERATOR_ALLOWED_TOLERATIONS", '[{"key": "a", "effect": "X"}]')
    with pytest.raises(ValidationError, match="effect"):
        OperatorSettings()


# --- model names ----------------------------------------------------------------------------


def claim(namespace: str, name: str, created: str, model: str = "llama") -> ModelClaim:
    return ModelClaim(namespace=namespace, name=name, model=model, created=created)


def test_the_oldest_pool_keeps_a_model_name():
    old = claim("b", "x", "2026-01-01T00:00:00Z")
    young = claim("a", "y", "2026-01-02T00:00:00Z")
    other_model = claim("a", "z", "2025-01-01T00:00:00Z", model="other")
    claims = [old, young, other_model]
    assert model_name_winner(old, claims) is None
    assert model_name_winner(young, claims) == old
    assert model_name_winner(other_model, claims) is None
    # Same second: namespace, then name, decides.
    twin = claim("a", "w", "2026-01-01T00:00:00Z")
    assert model_name_winner(old, [old, twin]) == twin
    assert model_name_winner(twin, [old, twin]) is None


# --- Pod Security Standards -----------------------------------------------------------------


def example_pools() -> list[InferencePool]:
    pools = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferencePool":
                doc["metadata"].setdefault("namespace", "slotserve")
                pools.append(InferencePool.from_body(doc))
    return pools


@pytest.mark.parametrize(
    "pool",
    [
        make_pool(),
        make_pool(source={"pvc": {"claimName": "models"}}, serviceAccountName="engine"),
        make_pool(source={"hub": {"id": "org/model", "tokenSecretRef": {"name": "hf"}}}),
        *example_pools(),
    ],
    ids=lambda pool: (
        f"{pool.metadata.name}-{sorted(pool.spec.model.source.model_dump(exclude_none=True))[0]}"
    ),
)
def test_engine_pods_pass_the_restricted_pod_security_standard(pool: InferencePool):
    deployment = builders.build_deployment(pool, engine_image=IMAGE)
    template = deployment["spec"]["template"]
    annotations = template["metadata"].get("annotations", {})
    assert restricted_violations(template["spec"], annotations) == []


def test_the_checker_catches_what_restricted_forbids():
    pod = builders.build_pod_spec(
        make_pool(source={"hostPath": {"path": "/m"}}), engine_image=IMAGE
    )
    assert any("hostPath" in v for v in restricted_violations(pod))
    pod = builders.build_pod_spec(make_pool(), engine_image=IMAGE)
    pod["hostNetwork"] = True
    pod["containers"][0]["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    pod["securityContext"].pop("seccompProfile")
    found = restricted_violations(pod)
    assert any("hostNetwork" in v for v in found)
    assert any("SYS_ADMIN" in v for v in found)
    assert any("seccompProfile" in v for v in found)
    assert any("drop ALL" in v for v in found)


def test_example_namespace_enforces_restricted():
    (namespace,) = [
        doc
        for doc in yaml.safe_load_all((EXAMPLES / "namespace.yaml").read_text())
        if doc and doc["kind"] == "Namespace"
    ]
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


# --- NetworkPolicy --------------------------------------------------------------------------


def test_network_policy_admits_the_gateway_and_scrapers_on_the_engine_port():
    pool = make_pool("team-a")
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
    policy = build_network_policy(
        pool,
        gateway_namespace="slotserve",
        gateway_pod_labels=GATEWAY_LABELS,
        scraper_peers=scrapers,
    )
    kubernetes_validate.validate(policy, "1.37.0", strict=True)
    assert policy["metadata"]["namespace"] == "team-a"
    pod_labels = builders.build_deployment(pool, engine_image=IMAGE)["spec"]["template"][
        "metadata"
    ]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    gateway_rule, scraper_rule = policy["spec"]["ingress"]
    (gateway,) = gateway_rule["from"]
    assert gateway["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "slotserve"
    }
    assert gateway["podSelector"]["matchLabels"] == GATEWAY_LABELS
    assert scraper_rule["from"] == scrapers
    for rule in (gateway_rule, scraper_rule):
        assert rule["ports"] == [{"port": builders.ENGINE_PORT_NAME, "protocol": "TCP"}]
    # Without a gateway namespace the gateway is looked for in the pool's own namespace.
    local = build_network_policy(pool, gateway_namespace="", gateway_pod_labels=GATEWAY_LABELS)
    (rule,) = local["spec"]["ingress"]
    assert (
        rule["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        == "team-a"
    )


def test_engine_egress_is_dns_and_the_platform_s_hub_only():
    pool = make_pool("team-a")
    hub = [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]}]
    settings = from_env_text(engine_egress=True, engine_egress_hub=json.dumps(hub))
    policy = build_network_policy(
        pool,
        gateway_namespace="slotserve",
        gateway_pod_labels=GATEWAY_LABELS,
        egress=settings.engine_egress_rules(),
    )
    kubernetes_validate.validate(policy, "1.37.0", strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns, hub_rule = policy["spec"]["egress"]
    assert dns["to"] == DEFAULT_DNS_PEERS
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert hub_rule == hub[0]
    # Off by default: egress stays open (policyTypes Ingress only), as before.
    assert OperatorSettings().engine_egress_rules() is None
    open_policy = build_network_policy(
        pool, gateway_namespace="", gateway_pod_labels=GATEWAY_LABELS
    )
    assert "egress" not in open_policy["spec"]


# --- drift ----------------------------------------------------------------------------------


def served(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server returns it: metadata and defaults added."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u", resourceVersion="7", generation=1)
    if obj["kind"] == "Deployment":
        live["spec"]["progressDeadlineSeconds"] = 600
        pod = live["spec"]["template"]["spec"]
        pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default")
        pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    if obj["kind"] == "Service":
        live["spec"].update(clusterIP="10.0.0.1", sessionAffinity="None")
    live["status"] = {}
    return live


def test_server_defaults_are_not_drift_but_widening_by_hand_is():
    pool = make_pool()
    deployment = builders.build_deployment(pool, engine_image=IMAGE)
    service = builders.build_service(pool)
    policy = build_network_policy(pool, gateway_namespace="gw", gateway_pod_labels=GATEWAY_LABELS)
    for child in (deployment, service, policy):
        assert in_sync(child, served(child)), child["kind"]

    def edited(child: dict[str, Any], change: Any) -> dict[str, Any]:
        live = served(child)
        change(live)
        return live

    pod = lambda live: live["spec"]["template"]["spec"]  # noqa: E731
    container = lambda live: pod(live)["containers"][0]  # noqa: E731
    for change in (
        lambda live: container(live).update(image="evil/miner"),
        lambda live: container(live)["args"].append("--trust-remote-code"),
        lambda live: live["spec"].update(replicas=9),
        lambda live: pod(live).update(hostNetwork=True),
        lambda live: container(live)["securityContext"].update(privileged=True),
        lambda live: pod(live)["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
        lambda live: pod(live).update(serviceAccountName="admin"),
    ):
        assert not in_sync(deployment, edited(deployment, change))
    assert not in_sync(
        service, edited(service, lambda live: live["spec"]["selector"].update(x="y"))
    )
    narrowed = edited(policy, lambda live: live["spec"]["podSelector"]["matchLabels"].update(x="y"))
    assert not in_sync(policy, narrowed)
    opened = edited(policy, lambda live: live["spec"]["ingress"].append({}))
    assert not in_sync(policy, opened)
