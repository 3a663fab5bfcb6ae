"""Autoscaling from the admission queue, on the API emulator with real kopf, a real Redis and a
real gateway process.

Built in: the first request for a pool at zero (refused for lack of an engine) scales it 0 -> 1
within a refresh; a backlog scales it to demand / target at once; when the demand is gone it
returns to zero only after the scale-down window. KEDA: the operator renders a ScaledObject
that passes the check written from KEDA's documentation, and refuses (Degraded + Warning) when
KEDA's CRD is missing or another HPA already scales the pool.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, cast

import kubernetes.client
import pytest

from slotserve.operator.keda import KEDA_GROUP, KEDA_VERSION, SCALED_OBJECTS
from slotserve.operator.settings import OperatorSettings
from tests.gateway.gateway_support import Spawner, pool, write_pools
from tests.operator.keda_scaledobject import scaled_object_problems
from tests.operator.operator_harness import Kube, redis_operator_settings, spec_of
from tests.operator.test_operator_admission import Load, condition, create_pool
from tests.support import RedisServer, free_port, wait_until

pytestmark = pytest.mark.slow
MODEL = "chat"
KEDA_CRD = {
    # A stand-in for KEDA's CRD (names only; any spec is stored): what the operator checks for.
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{SCALED_OBJECTS}.{KEDA_GROUP}"},
    "spec": {
        "group": KEDA_GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "ScaledObject",
            "listKind": "ScaledObjectList",
            "plural": SCALED_OBJECTS,
            "singular": "scaledobject",
            "shortNames": ["so"],
        },
        "versions": [
            {
                "name": KEDA_VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}
KEDA = {"serverAddress": "http://prometheus.monitoring:9090"}


@pytest.fixture
def operator_settings(redis_server: RedisServer) -> OperatorSettings:
    # The platform names the Prometheus KEDA may query (none by default).
    return redis_operator_settings(
        redis_server.url, allowed_keda_server_addresses=[KEDA["serverAddress"]]
    )


def replicas(kube: Kube) -> int:
    return int(kube.get_pool("chat")["spec"]["replicas"])


def post(url: str) -> int:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


@pytest.mark.usefixtures("operator")
def test_builtin_scaler_wakes_from_zero_follows_the_backlog_and_returns_to_zero(
    kube: Kube, redis_server: RedisServer, spawn: Spawner, tmp_path: Path
):
    window_s = 4
    pools_file = tmp_path / "pools.yaml"
    # No engine yet: the pool's only endpoint answers nothing (a pool at zero).
    write_pools(pools_file, [pool(MODEL, [f"http://127.0.0.1:{free_port()}"])])
    # Holding off: a refusal is the demand (held requests: test_operator_cold_start.py).
    gateway = spawn.gateway(pools_file, redis_server.url, extra=["--no-hold-at-zero"]).url
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 3,
        "targetRequestsPerReplica": 2,
        "scaleDownWindowSeconds": window_s,
    }
    create_pool(kube, replicas=0, autoscaling=autoscaling)
    wait_until(lambda: kube.deployments(), 15, what="deployment")
    time.sleep(1)
    assert replicas(kube) == 0  # no demand: stays at zero

    started = time.monotonic()
    assert post(gateway) == 503  # no_ready_endpoint: the demand the scaler sees
    wait_until(lambda: replicas(kube) == 1, 10, what="0 -> 1 on the first request")
    woke_s = time.monotonic() - started
    wait_until(lambda: kube.deployment("chat")["spec"]["replicas"] == 1, 10, what="deployment")

    # The engine comes up: the gateway finds it, the kubelet marks the pod ready.
    double = spawn.double(slots=2, delay=0.05, model=MODEL)
    write_pools(pools_file, [pool(MODEL, [double.url])])
    pod = kube.start_pod(kube.deployment("chat"), 0, "10.0.0.5")
    kube.set_pod_ready(pod, "default", ip="10.0.0.5", ready=True)
    wait_until(lambda: post(gateway) == 200, 15, interval=0.3, what="the engine serves")

    # 6 clients, 1 s requests, 2 slots: demand 6 = 3 replicas at 2 per replica.
    with Load([gateway], clients=6, delay_s=1.0):
        started = time.monotonic()
        wait_until(lambda: replicas(kube) == 3, 15, what="1 -> 3 under a backlog")
        up_s = time.monotonic() - started
        time.sleep(12)  # long enough that the first refusal leaves the "recent" windows
        assert replicas(kube) == 3
    stopped = time.monotonic()
    wait_until(lambda: replicas(kube) == 0, window_s + 15, what="back to zero")
    down_s = time.monotonic() - stopped
    print(f"0->1 {woke_s:.2f} s after the first request; 1->3 {up_s:.2f} s; 3->0 {down_s:.2f} s")
    assert down_s >= window_s - 0.5  # never before the scale-down window

    def scaled() -> list[str]:
        return [e["message"] for e in kube.events() if e["reason"] == "Scaled"]

    # kopf posts events from its own queue, after the scale patch: the last one may lag a little.
    wait_until(lambda: " -> 0 replicas" in (scaled() or [""])[-1], 5, what="the last Scaled event")
    messages = scaled()
    assert any(m.startswith("0 -> 1 replicas") for m in messages), messages
    # Up to 3 under the backlog: in one step, or through 2 when the scaler read the queue while
    # the 6 clients were still arriving (both are right: demand is read at each refresh).
    steps = [tuple(map(int, m.split(" replicas")[0].split(" -> "))) for m in messages]
    ups = [(old, new) for old, new in steps if new > old]
    assert ups[0] == (0, 1) and ups[-1] in {(1, 3), (2, 3)}, messages
    assert " -> 0 replicas: 0 requests" in messages[-1], messages
    print("\n".join(messages))


@pytest.mark.parametrize("extra_crds", [[KEDA_CRD]])
@pytest.mark.usefixtures("operator")
def test_keda_provider_renders_a_documented_scaled_object_owned_by_the_pool(kube: Kube):
    create_pool(
        kube,
        autoscaling={"provider": "keda", "minReplicas": 0, "maxReplicas": 4, "keda": KEDA},
    )
    custom = kubernetes.client.CustomObjectsApi(kube.api_client)

    def scaled_object() -> dict[str, Any] | None:
        try:
            return cast(
                dict[str, Any],
                custom.get_namespaced_custom_object(
                    KEDA_GROUP, KEDA_VERSION, "default", SCALED_OBJECTS, "chat"
                ),
            )
        except kubernetes.client.exceptions.ApiException:
            return None

    wait_until(scaled_object, 15, what="ScaledObject")
    obj = scaled_object()
    assert obj is not None
    assert scaled_object_problems(obj, "default") == []
    assert obj["spec"]["scaleTargetRef"] == {
        "apiVersion": "slotserve.dev/v1alpha1",
        "kind": "InferencePool",
        "name": "chat",
    }
    (owner,) = obj["metadata"]["ownerReferences"]
    assert (
        owner["kind"] == "InferencePool"
        and owner["uid"] == kube.get_pool("chat")["metadata"]["uid"]
    )
    # A change of the spec reaches it.
    kube.patch_pool("chat", {"spec": {"autoscaling": {"maxReplicas": 7}}})
    wait_until(lambda: spec_of(scaled_object())["maxReplicaCount"] == 7, 15, what="patched")
    assert condition(kube, "Degraded")["status"] == "False"
    # Back to the built-in scaler: the ScaledObject goes, or KEDA would fight it.
    kube.patch_pool("chat", {"spec": {"autoscaling": {"provider": "builtin"}}})
    wait_until(lambda: scaled_object() is None, 15, what="ScaledObject deleted")
    # One a user made under the pool's name (not owned by it) is never deleted.
    custom.create_namespaced_custom_object(
        KEDA_GROUP, KEDA_VERSION, "default", SCALED_OBJECTS, {**obj, "metadata": {"name": "chat"}}
    )
    kube.patch_pool("chat", {"spec": {"autoscaling": {"maxReplicas": 6}}})
    wait_until(
        lambda: (
            kube.get_pool("chat")["status"].get("observedGeneration")
            == kube.get_pool("chat")["metadata"]["generation"]
        ),
        15,
        what="the change converged",
    )
    assert scaled_object() is not None


@pytest.mark.usefixtures("operator")
def test_keda_provider_without_keda_installed_is_degraded(kube: Kube):
    create_pool(kube, autoscaling={"provider": "keda", "maxReplicas": 4, "keda": KEDA})
    wait_until(
        lambda: condition(kube, "Degraded").get("reason") == "KedaNotInstalled",
        15,
        what="Degraded KedaNotInstalled",
    )
    assert not kube.deployments()  # nothing is written for a pool that cannot run
    wait_until(
        lambda: any(e["reason"] == "KedaNotInstalled" for e in kube.events()), 5, what="event"
    )


@pytest.mark.usefixtures("operator")
def test_builtin_scaler_beside_another_hpa_is_degraded(kube: Kube):
    hpas = kubernetes.client.AutoscalingV2Api(kube.api_client)
    # A dict body: the client sends it as it is (its types say a model object).
    hpas.create_namespaced_horizontal_pod_autoscaler(
        "default",
        {  # type: ignore[arg-type]
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "chat-hpa"},
            "spec": {
                "scaleTargetRef": {
                    "apiVersion": "slotserve.dev/v1alpha1",
                    "kind": "InferencePool",
                    "name": "chat",
                },
                "minReplicas": 1,
                "maxReplicas": 3,
            },
        },
    )
    create_pool(kube, autoscaling={"maxReplicas": 4})
    wait_until(
        lambda: condition(kube, "Degraded").get("reason") == "AutoscalerConflict",
        15,
        what="Degraded AutoscalerConflict",
    )
    assert "chat-hpa" in condition(kube, "Degraded")["message"]
    # Removing spec.autoscaling ends the conflict.
    kube.patch_pool("chat", {"spec": {"autoscaling": None}})
    wait_until(lambda: condition(kube, "Degraded").get("status") == "False", 15, what="healed")


NO_REDIS = OperatorSettings(
    engine_image="registry.test/slotserve/engine:test", health_port=free_port()
)


@pytest.mark.parametrize("operator_settings", [NO_REDIS])
@pytest.mark.usefixtures("operator")
def test_builtin_scaler_without_redis_is_degraded(kube: Kube):
    create_pool(kube, autoscaling={"maxReplicas": 4})
    wait_until(
        lambda: condition(kube, "Degraded").get("reason") == "AutoscalingUnavailable",
        15,
        what="Degraded AutoscalingUnavailable",
    )
