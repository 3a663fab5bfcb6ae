"""Self-healing with the real kopf runtime: children deleted or edited by hand come back.

Each test measures how long the repair took (printed with -s) and holds it under 10 s.
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Any

import kmock
import kubernetes.client
import pytest

from slotserve.operator.healer import backoff_seconds
from slotserve.operator.settings import OperatorSettings
from tests.operator.operator_harness import Kube, OperatorThread, assert_rbac_covers
from tests.operator.test_operator_kmock import WAIT, pool_body, wait_status
from tests.support import free_port, wait_until

RESTORE_WITHIN_S = 10
DEPLOYMENTS = "apps/v1/deployments"


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def timed_restore(predicate: Any, what: str) -> float:
    started = time.monotonic()
    wait_until(predicate, RESTORE_WITHIN_S, interval=0.05, what=what)
    elapsed = time.monotonic() - started
    print(f"{what}: {elapsed:.2f} s")
    return elapsed


def ready_pool(kube: Kube) -> dict[str, Any]:
    kube.create_pool(pool_body(replicas=2))
    wait_until(lambda: kube.deployments() and kube.services(), WAIT, what="children")
    wait_status(kube, "chat", lambda p: p.get("status", {}).get("observedGeneration") == 1, "s")
    return kube.deployment("chat")


def networking(kube: Kube) -> kubernetes.client.NetworkingV1Api:
    return kubernetes.client.NetworkingV1Api(kube.api_client)


def policy(kube: Kube) -> dict[str, Any]:
    response = networking(kube).read_namespaced_network_policy(
        "chat", "default", _preload_content=False
    )
    return kube._json(response)


@pytest.mark.usefixtures("operator")
def test_deleted_children_come_back_within_seconds(kube: Kube):
    old = ready_pool(kube)
    kube.apps.delete_namespaced_deployment("chat", "default", _preload_content=False)

    def recreated() -> bool:
        return [d["metadata"]["uid"] for d in kube.deployments()] not in (
            [],
            [old["metadata"]["uid"]],
        )

    timed_restore(recreated, "deleted Deployment re-created")
    kube.core.delete_namespaced_service("chat", "default", _preload_content=False)
    timed_restore(lambda: kube.services(), "deleted Service re-created")
    networking(kube).delete_namespaced_network_policy("chat", "default", _preload_content=False)

    def policies() -> list[Any]:
        response = networking(kube).list_namespaced_network_policy(
            "default", _preload_content=False
        )
        return list(kube._json(response)["items"])

    timed_restore(policies, "deleted NetworkPolicy re-created")


@pytest.mark.usefixtures("operator")
def test_hand_edits_of_children_are_reverted(kube: Kube):
    built = ready_pool(kube)
    image, args = container(built)["image"], container(built)["args"]

    kube.apps.patch_namespaced_deployment(
        "chat",
        "default",
        {
            "spec": {
                "template": {
                    "spec": {"containers": [{**container(built), "image": "evil/miner:1"}]}
                }
            }
        },
        _content_type="application/merge-patch+json",
        _preload_content=False,
    )
    timed_restore(lambda: container(kube.deployment("chat"))["image"] == image, "image reverted")

    edited = {**container(built), "args": [*args, "--trust-remote-code"]}
    kube.apps.patch_namespaced_deployment(
        "chat",
        "default",
        {"spec": {"template": {"spec": {"containers": [edited], "hostNetwork": True}}}},
        _content_type="application/merge-patch+json",
        _preload_content=False,
    )

    def widened_reverted() -> bool:
        pod = kube.deployment("chat")["spec"]["template"]["spec"]
        return pod["containers"][0]["args"] == args and "hostNetwork" not in pod

    timed_restore(widened_reverted, "args and hostNetwork reverted")

    # `kubectl scale deployment` bypasses the pool: the pool's replicas win (scale the pool).
    kube.apps.patch_namespaced_deployment_scale(
        "chat", "default", {"spec": {"replicas": 7}}, _preload_content=False
    )
    timed_restore(lambda: kube.deployment("chat")["spec"]["replicas"] == 2, "replicas reverted")

    kube.core.patch_namespaced_service(
        "chat",
        "default",
        {"spec": {"selector": {"app": "someone-else"}}},
        _content_type="application/merge-patch+json",
        _preload_content=False,
    )
    timed_restore(
        lambda: "app" not in kube.services()[0]["spec"]["selector"], "Service selector reverted"
    )

    # An "allow everything" rule added to the NetworkPolicy is taken out again.
    opened = copy.deepcopy(policy(kube)["spec"])
    opened["ingress"].append({})
    networking(kube).patch_namespaced_network_policy(
        "chat",
        "default",
        {"spec": opened},
        _content_type="application/merge-patch+json",
        _preload_content=False,
    )
    timed_restore(lambda: {} not in policy(kube)["spec"]["ingress"], "NetworkPolicy reverted")
    assert kube.deployment("chat")["metadata"]["uid"] == built["metadata"]["uid"]  # patched


@pytest.mark.usefixtures("operator")
def test_a_failed_repair_is_retried_with_backoff(kube: Kube, apiserver: Any):
    ready_pool(kube)
    refusals: list[float] = []

    def flaky(plural: str, obj: dict[str, Any]) -> str:
        """A write path that is down for the next 3 Deployment writes (503, then fine)."""
        if plural == "deployments" and len(refusals) < 3:
            refusals.append(time.monotonic())
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="down")
        return ""

    apiserver.server.policies.append(flaky)
    kube.apps.delete_namespaced_deployment("chat", "default", _preload_content=False)
    timed_restore(lambda: kube.deployments(), "Deployment re-created after 3 refusals")
    assert len(refusals) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(refusals)]
    print("gaps between attempts:", [f"{gap:.2f}" for gap in gaps])
    # Each gap at least its scheduled delay (0.5 s, then 1 s: exponential, not a busy loop);
    # lower bounds only, as load only lengthens a gap (0.91 s then 1.17 s was seen under load,
    # which a ratio of the two gaps had refused).
    assert gaps[0] >= 0.9 * backoff_seconds(1) and gaps[1] >= 0.9 * backoff_seconds(2), gaps


def test_periodic_resync_repairs_what_no_event_reported(
    kube: Kube, apiserver: Any, operator_settings: OperatorSettings
):
    settings = operator_settings.model_copy(
        update={"resync_seconds": 1.0, "health_port": free_port()}
    )
    running = OperatorThread(settings).start()
    try:
        built = ready_pool(kube)
        # Change the stored object behind the watch's back (as if the event were lost).
        stored = apiserver.server.objects[DEPLOYMENTS, "default", "chat"]
        changed = copy.deepcopy(stored.raw)
        container(changed)["image"] = "evil/miner:1"
        stored.create(changed)
        assert container(kube.deployment("chat"))["image"] == "evil/miner:1"
        timed_restore(
            lambda: container(kube.deployment("chat"))["image"] == container(built)["image"],
            "silent edit repaired by the resync",
        )
    finally:
        running.stop()
    assert_rbac_covers(apiserver)


@pytest.mark.usefixtures("operator")
def test_a_failed_create_of_a_new_pool_is_retried_by_kopf(kube: Kube, apiserver: Any):
    refusals: list[float] = []

    def flaky(plural: str, obj: dict[str, Any]) -> str:
        if plural == "deployments" and len(refusals) < 2:
            refusals.append(time.monotonic())
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="down")
        return ""

    apiserver.server.policies.append(flaky)
    kube.create_pool(pool_body())
    timed_restore(lambda: kube.deployments(), "Deployment created after 2 refusals (kopf retry)")
    assert len(refusals) == 2
    # kopf's TemporaryError delays: 1 s after the first failure, 2 s after the second.
    assert refusals[1] - refusals[0] >= 0.9
