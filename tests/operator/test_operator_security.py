"""Policy, NetworkPolicies, model-name conflicts and scale to zero, with the real kopf runtime.

The API server is the emulator of tests/kubeapi; every wait is bounded.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest

from slotserve.contracts.crd import KIND
from slotserve.operator.settings import OperatorSettings
from tests.operator.operator_harness import Kube, OperatorThread, assert_rbac_covers
from tests.operator.test_operator_kmock import WAIT, condition, pool_body, wait_status
from tests.support import free_port, wait_until


def network_policies(kube: Kube, namespace: str = "default") -> list[dict[str, Any]]:
    api = kubernetes.client.NetworkingV1Api(kube.api_client)
    response = api.list_namespaced_network_policy(namespace, _preload_content=False)
    return kube._json(response)["items"]


def warnings(kube: Kube, name: str, reason: str, namespace: str = "default") -> list[str]:
    return [
        e["message"]
        for e in kube.events(namespace)
        if e["type"] == "Warning" and e["reason"] == reason and e["involvedObject"]["name"] == name
    ]


def wait_degraded(
    kube: Kube, name: str, reason: str, namespace: str = "default", *, events: bool = True
) -> dict:
    """Wait until pool ``name`` is Degraded for ``reason`` (and, for the operator's own
    refusals, its Warning event is posted)."""

    def degraded() -> bool:
        pool = kube.get_pool(name, namespace)
        return condition(pool, "Degraded").get("reason") == reason

    wait_until(degraded, WAIT, interval=0.1, what=f"{name} Degraded: {reason}")
    if events:
        wait_until(lambda: warnings(kube, name, reason, namespace), WAIT, what=f"{reason} event")
    return kube.get_pool(name, namespace)


@pytest.mark.usefixtures("operator")
def test_a_host_path_pool_is_refused_and_gets_no_child(kube: Kube):
    source = {"hostPath": {"path": "/var/lib/kubelet"}}
    kube.create_pool(pool_body(model={"name": "chat", "source": source}))
    pool = wait_degraded(kube, "chat", "HostPathNotAllowed")
    assert condition(pool, "Ready")["status"] == "False"
    assert "allow_host_path" in condition(pool, "Degraded")["message"]
    assert kube.deployments() == [] and kube.services() == [] and network_policies(kube) == []
    # A PersistentVolumeClaim instead: the pool runs.
    fixed = {"hostPath": None, "pvc": {"claimName": "models"}}
    kube.patch_pool("chat", {"spec": {"model": {"source": fixed}}})
    wait_until(lambda: kube.deployments(), WAIT, what="deployment after the fix")
    wait_status(kube, "chat", lambda p: condition(p, "Degraded")["status"] == "False", "healed")


def test_image_and_service_account_allow_lists(kube: Kube, apiserver: Any):
    settings = OperatorSettings(
        engine_image="registry.test/slotserve/engine:1",
        health_port=free_port(),
        allowed_images=["registry.test/slotserve/*"],
        allowed_service_accounts=["default/slotserve-*"],
    )
    running = OperatorThread(settings).start()
    try:
        kube.create_pool(pool_body("miner", engine={"image": "docker.io/evil/miner:1"}))
        kube.create_pool(pool_body("admin", engine={"serviceAccountName": "cluster-admin"}))
        kube.create_pool(pool_body("fine", engine={"serviceAccountName": "slotserve-engine"}))
        pool = wait_degraded(kube, "miner", "ImageNotAllowed")
        assert "docker.io/evil/miner:1" in condition(pool, "Degraded")["message"]
        wait_degraded(kube, "admin", "ServiceAccountNotAllowed")
        wait_until(lambda: kube.deployments(), WAIT, what="the allowed pool's deployment")
        assert [d["metadata"]["name"] for d in kube.deployments()] == ["fine"]
    finally:
        running.stop()
    assert_rbac_covers(apiserver)


@pytest.mark.usefixtures("operator")
def test_every_pool_gets_its_own_network_policy(kube: Kube):
    for namespace in ("default", "team-b"):
        kube.create_pool(pool_body(f"chat-{namespace}"), namespace)
    for namespace in ("default", "team-b"):
        wait_until(
            lambda n=namespace: network_policies(kube, n), WAIT, what=f"policy in {namespace}"
        )
        (policy,) = network_policies(kube, namespace)
        pool = kube.get_pool(f"chat-{namespace}", namespace)
        (owner,) = policy["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == (KIND, pool["metadata"]["uid"])
        pod_labels = kube.deployment(f"chat-{namespace}", namespace)["spec"]["template"]
        selector = policy["spec"]["podSelector"]["matchLabels"]
        assert selector.items() <= pod_labels["metadata"]["labels"].items()
        (gateway_rule,) = policy["spec"]["ingress"]
        assert (
            gateway_rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == "gateway"
        )
    # Deleting the pool deletes its policy (owner reference, garbage collector).
    kube.delete_pool("chat-team-b", "team-b")
    wait_until(lambda: not network_policies(kube, "team-b"), WAIT, what="policy removed")
    assert len(network_policies(kube)) == 1


@pytest.mark.usefixtures("operator")
def test_the_younger_of_two_pools_with_one_model_name_is_degraded(kube: Kube):
    kube.create_pool(pool_body("alpha", model={"name": "llama", "source": {"builtin": "smollm2"}}))
    wait_until(lambda: kube.deployments(), WAIT, what="alpha's deployment")
    younger = pool_body("beta", model={"name": "llama", "source": {"builtin": "smollm2"}})
    kube.create_pool(younger, "team-b")
    pool = wait_degraded(kube, "beta", "ModelNameConflict", "team-b")
    assert "default/alpha" in condition(pool, "Degraded")["message"]
    assert any(
        "default/alpha" in message
        for message in warnings(kube, "beta", "ModelNameConflict", "team-b")
    )
    assert kube.deployments("team-b") == []
    assert condition(kube.get_pool("alpha"), "Degraded")["status"] == "False"
    # The older pool goes: the younger one takes the name over and starts its engines.
    kube.delete_pool("alpha")
    wait_until(lambda: kube.deployments("team-b"), WAIT, what="beta's deployment")

    def healed() -> bool:
        return condition(kube.get_pool("beta", "team-b"), "Degraded").get("status") == "False"

    wait_until(healed, WAIT, what="beta no longer degraded")


@pytest.mark.usefixtures("operator")
def test_renaming_the_model_ends_the_conflict(kube: Kube):
    kube.create_pool(pool_body("alpha", model={"name": "llama", "source": {"builtin": "smollm2"}}))
    kube.create_pool(pool_body("beta", model={"name": "llama", "source": {"builtin": "smollm2"}}))
    wait_degraded(kube, "beta", "ModelNameConflict")
    kube.patch_pool("beta", {"spec": {"model": {"name": "llama-b"}}})
    wait_status(kube, "beta", lambda p: condition(p, "Degraded")["status"] == "False", "healed")
    assert sorted(d["metadata"]["name"] for d in kube.deployments()) == ["alpha", "beta"]


@pytest.mark.usefixtures("operator")
def test_scale_to_zero_has_a_clear_status(kube: Kube):
    kube.create_pool(pool_body(replicas=1))
    wait_until(lambda: kube.deployments(), WAIT, what="deployment")
    pod = kube.start_pod(kube.deployment("chat"), 0, "10.1.0.5")
    kube.set_pod_ready(pod, "default", ip="10.1.0.5", ready=True)
    wait_status(kube, "chat", lambda p: p["status"]["endpoints"] == ["10.1.0.5:8000"], "endpoint")
    kube.scale_pool("chat", 0)
    # No endpoints at once, even while the last pod is still shutting down.
    pool = wait_status(
        kube, "chat", lambda p: condition(p, "Ready").get("reason") == "ScaledToZero", "scaled"
    )
    assert condition(pool, "Ready")["status"] == "False"
    assert pool["status"]["endpoints"] == []
    assert condition(pool, "Degraded")["status"] == "False"
    wait_until(lambda: kube.deployment("chat")["spec"]["replicas"] == 0, WAIT, what="0 replicas")


@pytest.mark.usefixtures("operator")
def test_an_older_pool_taking_a_name_degrades_the_younger_without_its_spec_changing(kube: Kube):
    kube.create_pool(pool_body("alpha", model={"name": "llama", "source": {"builtin": "smollm2"}}))
    kube.create_pool(pool_body("beta", model={"name": "qwen", "source": {"builtin": "smollm2"}}))
    wait_until(lambda: len(kube.deployments()) == 2, WAIT, what="both deployments")
    # Only alpha changes; beta's conflict is found by re-checking the pools that share a name.
    kube.patch_pool("alpha", {"spec": {"model": {"name": "qwen"}}})
    pool = wait_degraded(kube, "beta", "ModelNameConflict")
    assert "default/alpha" in condition(pool, "Degraded")["message"]
    assert kube.get_pool("beta")["metadata"]["generation"] == 1
    assert condition(kube.get_pool("alpha"), "Degraded")["status"] == "False"


# --- issue 27: env and scheduling allow-lists, egress, the device -------------------------------

GPU = {"limits": {"nvidia.com/gpu": 1}}
# (pool name, engine or autoscaling spec, reason, what the condition and the event must name)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("cc", {"engine": {"env": [{"name": "CC", "value": "/models/bin/x"}]}}, "EnvNotAllowed", "CC"),
    (
        "home",
        {"engine": {"env": [{"name": "SLOTSERVE_HOME", "value": "/models"}]}},
        "EnvNotAllowed",
        "SLOTSERVE_HOME",
    ),
    (
        "endpoint",
        {"engine": {"env": [{"name": "HF_ENDPOINT", "value": "https://collector.example"}]}},
        "EnvNotAllowed",
        "HF_ENDPOINT",
    ),
    (
        "preempt",
        {"engine": {"priorityClassName": "system-cluster-critical"}},
        "PriorityClassNotAllowed",
        "system-cluster-critical",
    ),
    (
        "control",
        {
            "engine": {
                "tolerations": [
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                ],
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
            }
        },
        "TolerationNotAllowed",
        "node-role.kubernetes.io/control-plane",
    ),
    (
        "pinned",
        {"engine": {"nodeSelector": {"kubernetes.io/hostname": "team-b-node-1"}}},
        "NodeSelectorNotAllowed",
        "kubernetes.io/hostname",
    ),
    (
        "scaler",
        {
            "autoscaling": {
                "provider": "keda",
                "maxReplicas": 2,
                "keda": {"serverAddress": "http://collector.example:9090"},
            }
        },
        "KedaServerNotAllowed",
        "http://collector.example:9090",
    ),
]


@pytest.mark.usefixtures("operator")
def test_pools_outside_the_allow_lists_are_refused_naming_what_and_get_no_child(kube: Kube):
    for name, spec, _, _ in REFUSED:
        kube.create_pool(pool_body(name, **spec))
    for name, _, reason, named in REFUSED:
        pool = wait_degraded(kube, name, reason)
        assert named in condition(pool, "Degraded")["message"], name
        assert any(named in message for message in warnings(kube, name, reason)), name
    # Nothing half-applied: not one child for any of them.
    assert kube.deployments() == [] and kube.services() == [] and network_policies(kube) == []
    # Without the refused variable the pool runs, with the operator's environment intact.
    kube.patch_pool("cc", {"spec": {"engine": {"env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}}})
    wait_until(lambda: kube.deployments(), WAIT, what="deployment after the fix")
    (deployment,) = kube.deployments()
    env = {
        v["name"]: v.get("value")
        for v in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["HF_HUB_OFFLINE"] == "1" and env["HOME"] == "/tmp" and "CC" not in env


def test_tightening_the_policy_marks_running_pools_and_changes_nothing(kube: Kube):
    """A platform drops CC from its allowed list: the pool that uses it keeps serving on the
    pods it has, turns Degraded with an event naming CC, and nothing of it is rewritten."""
    loose = OperatorSettings(
        engine_image="registry.test/slotserve/engine:1",
        health_port=free_port(),
        allowed_env=["CC"],
    )
    running = OperatorThread(loose).start()
    try:
        kube.create_pool(pool_body(engine={"env": [{"name": "CC", "value": "gcc"}]}))
        wait_until(lambda: kube.deployments(), WAIT, what="deployment")
        deployment = kube.deployments()[0]
        pod = kube.start_pod(deployment, 0, "10.1.0.1")
        kube.set_pod_ready(pod, "default", ip="10.1.0.1", ready=True)
        wait_status(kube, "chat", lambda p: p["status"].get("readyReplicas") == 1, "ready")
    finally:
        running.stop()
    before = {
        obj["kind"]: (obj["metadata"]["uid"], obj["metadata"]["resourceVersion"])
        for obj in (kube.deployment("chat"), *kube.services(), *network_policies(kube))
    }
    tight = loose.model_copy(update={"allowed_env": [], "health_port": free_port()})
    running = OperatorThread(tight).start()
    try:
        pool = wait_degraded(kube, "chat", "EnvNotAllowed")
        assert "engine.env sets CC" in condition(pool, "Degraded")["message"]
        # Marked, not killed: the pod serving the last good spec still serves.
        assert condition(pool, "Ready")["status"] == "True"
        assert pool["status"]["endpoints"] == ["10.1.0.1:8000"]
        after = {
            obj["kind"]: (obj["metadata"]["uid"], obj["metadata"]["resourceVersion"])
            for obj in (kube.deployment("chat"), *kube.services(), *network_policies(kube))
        }
        assert after == before
    finally:
        running.stop()


def test_egress_and_the_device_reach_the_children_and_a_pod_without_a_gpu_says_why(
    kube: Kube, apiserver: Any
):
    hub = [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]}]
    settings = OperatorSettings(
        engine_image="registry.test/slotserve/engine:1",
        health_port=free_port(),
        engine_egress=True,
        engine_egress_hub=hub,
        hub_endpoint="http://hub.mirror.svc:8080",
    )
    running = OperatorThread(settings).start()
    try:
        kube.create_pool(pool_body(engine={"resources": GPU}))
        wait_until(lambda: kube.deployments() and network_policies(kube), WAIT, what="children")
        (policy,) = network_policies(kube)
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert policy["spec"]["egress"][1:] == hub
        deployment = kube.deployment("chat")
        engine = deployment["spec"]["template"]["spec"]["containers"][0]
        assert engine["args"][-2:] == ["--device", "cuda"]
        assert {"name": "HF_ENDPOINT", "value": "http://hub.mirror.svc:8080"} in engine["env"]
        # The node's GPU is unusable: the engine exits 2 with one line; the pool says so.
        pod = kube.start_pod(deployment, 0, "10.1.0.1")
        line = (
            "slotserve engine: cannot start: --device cuda: no usable GPU "
            "(torch sees 0 CUDA devices)"
        )
        kube.set_engine_exited(pod, "default", 2, f"some earlier log line\n{line}\n")
        pool = wait_degraded(kube, "chat", "EngineCannotStart", events=False)
        assert condition(pool, "Degraded")["message"] == f"pod {pod}: the engine exited 2: {line}"
    finally:
        running.stop()
    assert_rbac_covers(apiserver)
