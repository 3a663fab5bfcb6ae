"""The real operator (kopf runtime + kubernetes client) against a Kubernetes API emulator.

The emulator of tests/kubeapi (on kmock) plays the API server; the tests play the
controllers it lacks (ReplicaSets, kubelet) by creating pods and writing their status.
Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kmock
import kubernetes_validate
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from slotserve.contracts.crd import API_VERSION, KIND
from slotserve.operator.settings import OperatorSettings
from tests.operator.operator_harness import Kube, OperatorThread, assert_rbac_covers, raw_json
from tests.support import free_port, http_ok, wait_until

WAIT = 15
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def pool_body(name: str = "chat", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        # One model name per pool: two pools serving one name are a ModelNameConflict.
        "spec": {"model": {"name": name, "source": {"builtin": "smollm2"}}, **spec},
    }


def condition(pool: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (pool.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def wait_status(kube: Kube, name: str, predicate: Any, what: str) -> dict[str, Any]:
    wait_until(lambda: predicate(kube.get_pool(name)), WAIT, interval=0.1, what=what)
    return kube.get_pool(name)


def assert_gateway_reads(pool: dict[str, Any], max_batch_size: int):
    """The contract with the gateway: what its Kubernetes discovery makes of the pool object.

    (The engines it routes to come from the EndpointSlices of the pool's Service, not from
    status.endpoints; test_operator_engines.py covers that path.)
    """
    discovery = pytest.importorskip("slotserve.gateway.pools.discovery")
    seen = discovery.pool_from_inference_pool(pool)
    assert seen.model == pool["spec"]["model"]["name"]
    assert seen.batching.max_batch_size == max_batch_size


def args_of(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.usefixtures("operator")
def test_create_builds_owned_children_and_status_follows_the_pods(kube: Kube, apiserver: Any):
    pool = kube.create_pool(pool_body(replicas=2, batching={"maxBatchSize": 8}))
    uid = pool["metadata"]["uid"]
    wait_until(lambda: kube.deployments() and kube.services(), WAIT, what="children")
    (deployment,) = kube.deployments()
    (service,) = kube.services()
    for child in (deployment, service):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == KIND and owner["controller"] is True
    assert deployment["spec"]["replicas"] == 2
    assert "--max-batch-size" in args_of(deployment)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":test")

    status = wait_status(
        kube, "chat", lambda p: p.get("status", {}).get("observedGeneration") == 1, "status"
    )["status"]
    assert status["selector"] == "app.kubernetes.io/component=engine,slotserve.dev/pool=chat"
    assert status["endpoints"] == [] and status["readyReplicas"] == 0
    assert condition(kube.get_pool("chat"), "Ready")["reason"] == "NoReplicasReady"

    # Only the engine pods are watched (server-side label selector), not every pod.
    pod_watches = [c for c in apiserver.server.calls if c[0].startswith("kopf/") and c[3] == "pods"]
    assert pod_watches and all("slotserve.dev/pool" in c[4] for c in pod_watches)

    # The "kubelet": two pods start, then become ready; the gateway's endpoints follow.
    first = kube.start_pod(deployment, 0, "10.1.0.1")
    second = kube.start_pod(deployment, 1, "10.1.0.2")
    kube.set_pod_ready(first, "default", ip="10.1.0.1", ready=True)
    pool = wait_status(
        kube, "chat", lambda p: p["status"]["endpoints"] == ["10.1.0.1:8000"], "1 endpoint"
    )
    assert condition(pool, "Ready")["reason"] == "SomeReplicasReady"
    kube.set_pod_ready(second, "default", ip="10.1.0.2", ready=True)
    kube.finish_rollout("chat")
    pool = wait_status(
        kube,
        "chat",
        lambda p: condition(p, "Progressing").get("reason") == "RolloutComplete",
        "rollout complete",
    )
    assert pool["status"]["endpoints"] == ["10.1.0.1:8000", "10.1.0.2:8000"]
    assert pool["status"]["readyReplicas"] == pool["status"]["replicas"] == 2
    assert condition(pool, "Ready")["status"] == "True"
    assert condition(pool, "Degraded")["status"] == "False"
    assert_gateway_reads(pool, max_batch_size=8)

    # A pod stops being ready: it leaves the endpoints at once.
    kube.set_pod_ready(first, "default", ip="10.1.0.1", ready=False)
    wait_status(
        kube, "chat", lambda p: p["status"]["endpoints"] == ["10.1.0.2:8000"], "endpoint removed"
    )
    # A crash-looping engine degrades the pool, with the reason.
    kube.set_pod_waiting(first, "default", "CrashLoopBackOff", "back-off restarting engine")
    pool = wait_status(
        kube, "chat", lambda p: condition(p, "Degraded").get("status") == "True", "degraded"
    )
    assert condition(pool, "Degraded")["reason"] == "CrashLoopBackOff"


@pytest.mark.usefixtures("operator")
def test_spec_change_patches_the_deployment_in_place(kube: Kube):
    selector = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "L4"}
    kube.create_pool(pool_body(engine={"nodeSelector": selector}))
    wait_until(lambda: kube.deployments(), WAIT, what="deployment")
    before = kube.deployment("chat")
    kube.patch_pool(
        "chat",
        {
            "spec": {
                "batching": {"maxBatchSize": 4},
                "engine": {"nodeSelector": {"nvidia.com/gpu.product": None}},
            }
        },
    )

    def updated() -> bool:
        args = args_of(kube.deployment("chat"))
        return args[args.index("--max-batch-size") + 1] == "4"

    wait_until(updated, WAIT, what="patched deployment")
    after = kube.deployment("chat")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # patched, not re-created
    assert len(kube.deployments()) == 1
    # A key removed from the pool is removed from the Deployment too.
    assert after["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    wait_status(
        kube, "chat", lambda p: p["status"].get("observedGeneration") == 2, "observed gen 2"
    )

    # `kubectl scale ipool chat --replicas 3` goes through the scale subresource.
    kube.scale_pool("chat", 3)
    wait_until(lambda: kube.deployment("chat")["spec"]["replicas"] == 3, WAIT, what="scaled")
    assert kube.deployment("chat")["metadata"]["uid"] == before["metadata"]["uid"]


def test_schema_violations_are_rejected_with_422(kube: Kube):
    invalid: list[dict[str, Any]] = [
        {"replicas": -1},
        {"batching": {"policy": "greedy"}},
        {"model": {"name": "x"}},
        {"model": {"name": "x", "source": {"builtin": "smollm2"}, "quantization": "int3"}},
    ]
    for spec in invalid:
        with pytest.raises(ApiException) as raised:
            kube.create_pool(pool_body("bad", **spec))
        assert raised.value.status == 422, spec
    body = raised.value.body
    assert body is not None and "spec.model.quantization" in body  # the last one names the field
    kube.create_pool(pool_body("good"))
    with pytest.raises(ApiException) as raised:
        kube.patch_pool("good", {"spec": {"admission": {"maxQueueSize": -5}}})
    assert raised.value.status == 422
    assert kube.get_pool("good")["spec"]["replicas"] == 1  # defaulted, and unchanged


@pytest.mark.usefixtures("operator")
@pytest.mark.parametrize(
    ("name", "spec", "reason", "fix"),
    [
        # A valid object name that cannot name a Service.
        ("8b-model", {}, "InvalidName", None),
        # A CEL rule; the emulator does not evaluate CEL, the operator's models do.
        (
            "chat",
            {"batching": {"maxBatchSize": 4, "preferredBatchSizes": [8]}},
            "InvalidSpec",
            {"batching": {"preferredBatchSizes": [2, 4]}},
        ),
        # Map keys: OpenAPI v3.0 cannot constrain them.
        (
            "keys",
            {"engine": {"nodeSelector": {"bad key!": "x"}}},
            "InvalidSpec",
            {"engine": {"nodeSelector": {"bad key!": None, "nvidia.com/gpu.present": "true"}}},
        ),
    ],
)
def test_specs_the_schema_cannot_catch_degrade_with_an_event(
    kube: Kube, name: str, spec: dict[str, Any], reason: str, fix: dict[str, Any] | None
):
    kube.create_pool(pool_body(name, **spec))
    pool = wait_status(
        kube, name, lambda p: condition(p, "Degraded").get("reason") == reason, reason
    )
    assert condition(pool, "Ready")["status"] == "False"
    assert pool["status"]["observedGeneration"] == 1
    wait_until(
        lambda: any(
            e["reason"] == reason and e["type"] == "Warning" and e["involvedObject"]["name"] == name
            for e in kube.events()
        ),
        WAIT,
        what="warning event",
    )
    assert kube.deployments() == []
    if fix is not None:  # fixing the spec recovers
        kube.patch_pool(name, {"spec": fix})
        wait_until(lambda: kube.deployments(), WAIT, what="deployment after fix")
        wait_status(
            kube, name, lambda p: condition(p, "Degraded").get("status") == "False", "healed"
        )


@pytest.mark.usefixtures("operator")
def test_a_taken_child_name_is_a_conflict_not_a_takeover(kube: Kube):
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "default", "labels": {"team": "other"}},
        "spec": {
            "selector": {"matchLabels": {"team": "other"}},
            "template": {
                "metadata": {"labels": {"team": "other"}},
                "spec": {"containers": [{"name": "web", "image": "nginx"}]},
            },
        },
    }
    # A dict body: the client sends it as it is (its types say a V1Deployment).
    kube.apps.create_namespaced_deployment("default", foreign, _preload_content=False)  # type: ignore[arg-type]
    kube.create_pool(pool_body())
    pool = wait_status(
        kube,
        "chat",
        lambda p: condition(p, "Degraded").get("reason") == "ChildConflict",
        "conflict",
    )
    assert "not owned by this pool" in condition(pool, "Degraded")["message"]
    untouched = kube.deployment("chat")
    assert untouched["metadata"].get("ownerReferences") is None
    assert untouched["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx"


def test_restarted_operator_converges_without_duplicates(
    kube: Kube, operator_settings: OperatorSettings
):
    first = OperatorThread(operator_settings).start()
    try:
        kube.create_pool(pool_body("alpha"))
        wait_until(lambda: len(kube.deployments()) == 1, WAIT, what="alpha deployment")
    finally:
        first.stop()
    alpha_uid = kube.deployment("alpha")["metadata"]["uid"]
    # While no operator runs: a new pool, a changed pool, a child deleted by hand.
    kube.create_pool(pool_body("beta"))
    kube.patch_pool("alpha", {"spec": {"replicas": 3}})
    kube.core.delete_namespaced_service("alpha", "default", _preload_content=False)

    second = OperatorThread(operator_settings).start()
    try:
        wait_until(
            lambda: (
                sorted(d["metadata"]["name"] for d in kube.deployments()) == ["alpha", "beta"]
                and kube.deployment("alpha")["spec"]["replicas"] == 3
                and sorted(s["metadata"]["name"] for s in kube.services()) == ["alpha", "beta"]
            ),
            WAIT,
            what="convergence after restart",
        )
        assert kube.deployment("alpha")["metadata"]["uid"] == alpha_uid
        for name, generation in (("alpha", 2), ("beta", 1)):
            wait_status(
                kube,
                name,
                lambda p, g=generation: p.get("status", {}).get("observedGeneration") == g,
                f"{name} observed",
            )
    finally:
        second.stop()
    assert len(kube.deployments()) == 2 and len(kube.services()) == 2


@pytest.mark.usefixtures("operator")
def test_a_child_deleted_by_hand_comes_back(kube: Kube):
    kube.create_pool(pool_body())
    wait_until(lambda: kube.deployments(), WAIT, what="deployment")
    old_uid = kube.deployment("chat")["metadata"]["uid"]
    kube.apps.delete_namespaced_deployment("chat", "default", _preload_content=False)
    wait_until(
        lambda: [d["metadata"]["uid"] for d in kube.deployments()] not in ([], [old_uid]),
        WAIT,
        what="re-created deployment",
    )


@pytest.mark.usefixtures("operator")
def test_deleting_the_pool_removes_its_children(kube: Kube):
    kube.create_pool(pool_body())
    wait_until(lambda: kube.deployments() and kube.services(), WAIT, what="children")
    kube.start_pod(kube.deployment("chat"), 0, "10.1.0.9")
    assert kube.pods()
    kube.delete_pool("chat")
    # The garbage collector follows the owner references: pool -> Deployment, Service -> pods.
    wait_until(
        lambda: not kube.deployments() and not kube.services() and not kube.pods(),
        WAIT,
        what="cleanup",
    )
    # ... and the operator does not bring them back for a pool that is gone.
    with pytest.raises(TimeoutError):
        wait_until(lambda: kube.deployments(), 1.5, what="nothing re-created")


def test_health_endpoint(operator: OperatorThread):
    url = f"http://127.0.0.1:{operator.settings.health_port}/healthz"
    wait_until(lambda: http_ok(url), WAIT, what="healthz")


@pytest.mark.usefixtures("operator")
def test_watch_reconnects_resume_without_replaying_creation(kube: Kube, apiserver: Any):
    kube.create_pool(pool_body())
    wait_until(lambda: kube.deployments() and kube.services(), WAIT, what="children")
    wait_status(
        kube,
        "chat",
        lambda p: (
            p.get("status", {}).get("observedGeneration") == 1
            # kopf records the handled spec after the handler: the last write of a reconcile.
            and "slotserve.dev/last-handled-configuration" in p["metadata"].get("annotations", {})
        ),
        "reconciled",
    )
    before = list(apiserver.server.writes)
    # Several server-side watch timeouts pass: kopf reconnects with ?resourceVersion=...
    server = apiserver.server
    resumed_before = server.num_resumed_watches
    wait_until(lambda: server.num_resumed_watches >= resumed_before + 8, WAIT, what="reconnects")
    time.sleep(1)
    assert apiserver.server.writes == before, "a resumed watch re-ran the reconcile"
    creates = [w for w in apiserver.server.writes if w[0] == "CREATE" and w[1] != "events"]
    assert sorted(w[1] for w in creates) == [
        "deployments",
        "inferencepools",
        "networkpolicies",
        "services",
    ]


def test_the_cli_process_reconciles_and_stops_on_sigterm(kube: Kube, apiserver: Any):
    # Cluster-wide: kmock answers GET /api/v1/namespaces (which kopf needs for --namespaces)
    # with a 500, so the namespaced mode is covered by the cluster end-to-end test only.
    port = free_port()
    env = {**os.environ, "SLOTSERVE_OPERATOR_ENGINE_IMAGE": "registry.test/engine:cli"}
    process = subprocess.Popen(
        [sys.executable, "-m", "slotserve.cli", "operator", "--health-port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), 30, what="healthz")
        kube.create_pool(pool_body())
        wait_until(lambda: kube.deployments(), WAIT, what="deployment from the CLI operator")
        image = kube.deployment("chat")["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.test/engine:cli"
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


@pytest.mark.usefixtures("operator")
@pytest.mark.parametrize("example", ["smollm2-cpu.yaml", "llama-8b-gpu.yaml"])
def test_examples_apply_and_their_children_are_valid_kubernetes(kube: Kube, example: str):
    body = yaml.safe_load((EXAMPLES / example).read_text())
    name = body["metadata"]["name"]
    kube.create_pool(body)
    wait_until(lambda: kube.deployments() and kube.services(), WAIT, what="children")
    # What the operator created, as stored (owner references and server metadata included).
    for child in (kube.deployment(name), kube.services()[0]):
        child.pop("status", None)
        kubernetes_validate.validate(child, "1.37.0", strict=True)
    pool = kube.get_pool(name)
    # What the example says is kept as written; the CRD only adds its defaults beside it.
    assert body["spec"]["admission"].items() <= pool["spec"]["admission"].items()


@pytest.mark.usefixtures("operator")
def test_a_child_refused_by_admission_degrades_the_pool(kube: Kube, apiserver: Any):
    # The cluster's own admission (a policy engine) refuses what the operator's policy allows.
    def no_team_x(plural: str, obj: dict[str, Any]) -> str:
        metadata = obj.get("spec", {}).get("template", {}).get("metadata", {})
        refused = (metadata.get("annotations") or {}).get("team") == "x"
        return "team x may not run engines" if refused else ""

    apiserver.server.policies.append(no_team_x)
    kube.create_pool(pool_body(engine={"podAnnotations": {"team": "x"}}))
    pool = wait_status(
        kube, "chat", lambda p: condition(p, "Degraded").get("reason") == "ChildRejected", "refused"
    )
    assert "team x may not run engines" in condition(pool, "Degraded")["message"]
    # kopf posts events from its own queue: the status can be visible before the event.
    wait_until(
        lambda: any(e["reason"] == "ChildRejected" for e in kube.events()), WAIT, what="event"
    )
    # Dropping the refused field recovers.
    kube.patch_pool("chat", {"spec": {"engine": {"podAnnotations": {"team": None}}}})
    wait_until(lambda: kube.deployments(), WAIT, what="deployment after the fix")


@pytest.mark.usefixtures("operator")
def test_an_invalid_update_leaves_the_running_engines_alone(kube: Kube):
    kube.create_pool(pool_body())
    wait_until(lambda: kube.deployments(), WAIT, what="deployment")
    wait_status(kube, "chat", lambda p: p.get("status", {}).get("observedGeneration") == 1, "s")
    before = kube.deployment("chat")["metadata"]
    kube.patch_pool("chat", {"spec": {"engine": {"nodeSelector": {"bad key!": "x"}}}})
    pool = wait_status(
        kube, "chat", lambda p: condition(p, "Degraded").get("reason") == "InvalidSpec", "invalid"
    )
    assert pool["status"]["observedGeneration"] == 2
    after = kube.deployment("chat")["metadata"]
    assert (after["uid"], after["resourceVersion"]) == (before["uid"], before["resourceVersion"])


def test_two_replicas_one_active_and_failover(kube: Kube, apiserver: Any):
    """kopf peering: the higher priority works, the other stands by, then takes over."""
    peerings = kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")
    apiserver.server.resources[peerings] = kmock.ResourceInfo(
        kind="ClusterKopfPeering",
        singular="clusterkopfpeering",
        namespaced=False,
        verbs=["create", "delete", "get", "list", "patch", "watch"],
    )
    kube.custom.create_cluster_custom_object(
        "kopf.dev",
        "v1",
        "clusterkopfpeerings",
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "slotserve"},
        },
        _preload_content=False,
    )

    def replica(priority: int, image: str) -> OperatorThread:
        settings = OperatorSettings(
            peering_name="slotserve",
            priority=priority,
            engine_image=image,
            health_port=free_port(),
        )
        return OperatorThread(settings).start()

    def image() -> str:
        return kube.deployment("chat")["spec"]["template"]["spec"]["containers"][0]["image"]

    def num_peers() -> int:
        peering = kube.custom.get_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", "slotserve", _preload_content=False
        )
        return len(raw_json(peering).get("status") or {})

    replicas = [leader := replica(200, "registry.test/engine:leader")]
    try:
        # kopf peering is not a lock: replicas starting at the same instant may both act
        # briefly (harmless: the reconcile is idempotent). Start the standby once the leader
        # is registered.
        wait_until(lambda: num_peers() == 1, WAIT, what="leader registered in the peering")
        replicas.append(replica(100, "registry.test/engine:standby"))
        kube.create_pool(pool_body())
        wait_until(lambda: kube.deployments(), WAIT, what="deployment")
        time.sleep(2)  # both replicas have seen the pool by now
        assert image() == "registry.test/engine:leader"
        deployment_writes = [w for w in apiserver.server.writes if w[1] == "deployments"]
        history = [
            v["spec"]["template"]["spec"]["containers"][0]["image"]
            for v in apiserver.server.objects["apps/v1/deployments", "default", "chat"].history
            if v is not None
        ]
        assert [w[0] for w in deployment_writes] == ["CREATE"], f"the standby acted: {history}"

        leader.stop()  # a clean exit retires it from the peering object at once
        wait_until(lambda: image() == "registry.test/engine:standby", 30, what="failover")
    finally:
        for running in replicas:
            if running.is_alive():
                running.stop()
    assert_rbac_covers(apiserver)
