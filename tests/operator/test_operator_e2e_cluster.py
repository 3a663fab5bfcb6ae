"""End to end on a real cluster (kind, k3d, ...): CRD, operator, a pool, Ready, a completion.

Runs only when SLOTSERVE_E2E_KUBECONFIG points at a cluster whose nodes can run the engine image
(see docs/operator.md: "End-to-end test on kind"); skipped otherwise. It applies the CRD, runs
`slotserve operator` as a process on this machine for a fresh namespace, applies a one-replica
smollm2 pool, waits for status Ready with an endpoint, asks the engine for a completion
through the API server's service proxy, deletes the pool and waits for the garbage collector to
remove its Deployment and Service. The namespace is deleted afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.operator.operator_harness import raw_json
from tests.support import free_port, http_ok, wait_until

E2E_KUBECONFIG = os.environ.get("SLOTSERVE_E2E_KUBECONFIG", "")
READY_TIMEOUT = float(os.environ.get("SLOTSERVE_E2E_READY_TIMEOUT", "900"))
ENGINE_IMAGE = os.environ.get("SLOTSERVE_E2E_ENGINE_IMAGE", "ghcr.io/slotserve/engine:0.1.0")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not E2E_KUBECONFIG, reason="set SLOTSERVE_E2E_KUBECONFIG to a cluster"),
]


@pytest.fixture(scope="module")
def api() -> Any:
    import kubernetes.client
    import kubernetes.config

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=E2E_KUBECONFIG, client_configuration=configuration
    )
    return kubernetes.client.ApiClient(configuration)


def _apply_crd(api: Any) -> None:
    import kubernetes.client
    from kubernetes.client.exceptions import ApiException

    from slotserve.operator.crd import build_crd

    extensions = kubernetes.client.ApiextensionsV1Api(api)
    body = build_crd()
    try:
        # A dict body: the client sends it as it is (its types say a model object).
        extensions.create_custom_resource_definition(body, _preload_content=False)  # type: ignore[arg-type]
    except ApiException as error:
        if error.status != 409:
            raise
        live = raw_json(
            extensions.read_custom_resource_definition(
                body["metadata"]["name"], _preload_content=False
            )
        )
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        extensions.replace_custom_resource_definition(
            body["metadata"]["name"],
            body,  # type: ignore[arg-type]
            _preload_content=False,
        )

    def established() -> bool:
        crd = raw_json(
            extensions.read_custom_resource_definition(
                body["metadata"]["name"], _preload_content=False
            )
        )
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_until(established, 60, interval=1, what="CRD established")


def _proxy(api: Any, method: str, namespace: str, service: str, path: str, body: Any = None):
    """Call the engine through the API server's service proxy (pod IPs are not routable here)."""
    params = api.param_serialize(
        method=method,
        resource_path=f"/api/v1/namespaces/{namespace}/services/{service}:http/proxy/{path}",
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*params, _request_timeout=120)
    response.read()
    return response.status, json.loads(response.data or b"null")


def test_pool_becomes_ready_and_serves_a_completion(api: Any, tmp_path: Path):
    import kubernetes.client

    from slotserve.contracts.crd import GROUP, PLURAL, VERSION

    _apply_crd(api)
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    namespace = f"slotserve-e2e-{secrets.token_hex(3)}"
    # Pod Security Admission enforces "restricted": the engine pods must pass the real thing.
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    core.create_namespace(
        {"metadata": {"name": namespace, "labels": labels}},  # type: ignore[arg-type]
        _preload_content=False,
    )
    health_port = free_port()
    log = (tmp_path / "operator.log").open("w")
    env = {
        **os.environ,
        "KUBECONFIG": E2E_KUBECONFIG,
        "SLOTSERVE_OPERATOR_ENGINE_IMAGE": ENGINE_IMAGE,
        # The test reaches the engine through the API server's service proxy, which connects
        # from a node address, not from a gateway pod: let it through the pool's NetworkPolicy
        # (on CNIs that enforce it, such as recent kindnet).
        "SLOTSERVE_OPERATOR_SCRAPER_PEERS": '[{"ipBlock": {"cidr": "0.0.0.0/0"}}]',
    }
    operator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotserve.cli",
            "operator",
            "--namespaces",
            namespace,
            "--health-port",
            str(health_port),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{health_port}/healthz"), 60, what="operator")
        pool = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferencePool",
            "metadata": {"name": "smollm2"},
            "spec": {
                "model": {"name": "smollm2", "source": {"builtin": "smollm2"}},
                "replicas": 1,
                "engine": {"imagePullPolicy": "IfNotPresent", "startupTimeoutSeconds": 600},
                "batching": {"maxBatchSize": 4},
            },
        }
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, pool, _preload_content=False
        )

        def ready() -> bool:
            body = raw_json(
                custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, "smollm2", _preload_content=False
                )
            )
            status = body.get("status") or {}
            return status.get("readyReplicas") == 1 and len(status.get("endpoints") or []) == 1

        started = time.monotonic()
        wait_until(ready, READY_TIMEOUT, interval=2, what="pool Ready")
        print(f"pool ready after {time.monotonic() - started:.0f}s")

        status, models = _proxy(api, "GET", namespace, "smollm2", "v1/models")
        assert status == 200 and models["data"][0]["id"] == "smollm2"
        status, answer = _proxy(
            api,
            "POST",
            namespace,
            "smollm2",
            "v1/completions",
            {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8},
        )
        assert status == 200 and answer["choices"][0]["text"].strip()

        networking = kubernetes.client.NetworkingV1Api(api)
        (policy,) = raw_json(
            networking.list_namespaced_network_policy(namespace, _preload_content=False)
        )["items"]
        assert policy["metadata"]["ownerReferences"][0]["name"] == "smollm2"

        # Deleting the pool deletes its children (the real garbage collector).
        custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "smollm2", _preload_content=False
        )
        apps = kubernetes.client.AppsV1Api(api)

        def children_gone() -> bool:
            deployments = raw_json(
                apps.list_namespaced_deployment(namespace, _preload_content=False)
            )["items"]
            services = raw_json(core.list_namespaced_service(namespace, _preload_content=False))[
                "items"
            ]
            policies = raw_json(
                networking.list_namespaced_network_policy(namespace, _preload_content=False)
            )["items"]
            return not deployments and not services and not policies

        wait_until(children_gone, 120, interval=2, what="children garbage-collected")
    finally:
        operator.terminate()
        try:
            operator.wait(20)
        except subprocess.TimeoutExpired:
            operator.kill()
        log.close()
        core.delete_namespace(namespace, _preload_content=False)
