"""Policy, NetworkPolicies, model-name conflicts and scale to zero, with the real kopf runtime.

The API server is the emulator of tests/kubeapi; every wait is bounded.
"""

from __future__ import annotations

from typing import Any

import kubernetes.client
import pytest
from operator_harness import Kube, OperatorThread, assert_rbac_covers
from support import free_port, wait_until
from test_operator_kmock import WAIT, condition, pool_body, wait_status

from slotserve.contracts.crd import KIND
from slotserve.operator.settings import OperatorSettings


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


def wait_degraded(kube: Kube, name: str, reason: str, namespace: str = "default") -> dict:
    def degraded() -> bool:
        pool = kube.get_pool(name, namespace)
        return condition(pool, "Degraded").get("reason") == reason

    wait_until(degraded, WAIT, interval=0.1, what=f"{name} Degraded: {reason}")
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
