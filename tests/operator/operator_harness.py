"""Test harness: the real operator (kopf) on its own thread and loop, and a small API client.

The API server they talk to is the emulator of tests/kubeapi (``kubeapi.ApiServerThread``).

kopf.operator() must not run inside pytest's event loop: on exit it cancels every task of its
loop, pytest's included. Each OperatorThread gets its own thread and loop and stops through
kopf's stop_flag, with bounded joins.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import kubernetes.client

from slotserve.contracts.crd import GROUP, PLURAL, VERSION
from slotserve.operator import cli, kube
from slotserve.operator.rbac import REQUIRED_RULES
from slotserve.operator.settings import OperatorSettings
from tests.support import free_port

WATCH_TIMEOUT_SECONDS = 1


def redis_operator_settings(redis_url: str, **extra: Any) -> OperatorSettings:
    """Settings of an operator that reads the gateways' Redis, refreshing every 0.5 s."""
    return OperatorSettings(
        engine_image="registry.test/slotserve/engine:test",
        health_port=free_port(),
        redis_url=redis_url,
        admission_refresh_seconds=0.5,
        **extra,
    )


def allowed(verb: str, group: str, resource: str) -> bool:
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in REQUIRED_RULES
    )


def assert_rbac_covers(apiserver: Any) -> None:
    """Every API call that kopf and the operator made is allowed by REQUIRED_RULES."""
    made = {
        call[1:4]
        for call in apiserver.server.calls
        if call[0].startswith(("kopf/", kube.USER_AGENT))
    }
    missing = sorted(call for call in made if not allowed(*call))
    assert not missing, f"calls outside REQUIRED_RULES (verb, group, resource): {missing}"


def spec_of(obj: dict[str, Any] | None) -> dict[str, Any]:
    """An object's spec, the object read as present (a wait on its spec fails if it is gone)."""
    assert obj is not None, "the object is gone"
    return obj["spec"]


def raw_json(response: Any) -> Any:
    """The JSON of an answer asked for with ``_preload_content=False``: urllib3's response,
    whatever the client's types say it returns."""
    return json.loads(response.data)


class OperatorThread:
    """``slotserve operator`` in-process: cluster-wide; standalone unless given a peering name."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        # Peering needs kopf's peering resource, which a test must add to the API server first.
        self.standalone = not settings.peering_name
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(
                cli.run(
                    self.settings,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    settings=self.kopf_settings(),
                    **({"standalone": True} if self.standalone else {}),
                )
            )
        except BaseException as error:
            self.error = error
            self.ready_flag.set()

    @staticmethod
    def kopf_settings() -> Any:
        settings = cli.kopf_settings()
        # Short server-side watch timeouts: every watch reconnects and resumes from its
        # resourceVersion during a test, which a real operator does every few minutes.
        settings.watching.server_timeout = WATCH_TIMEOUT_SECONDS
        settings.watching.client_timeout = WATCH_TIMEOUT_SECONDS + 5
        settings.watching.reconnect_backoff = 0.1
        return settings

    def start(self, timeout: float = 30) -> OperatorThread:
        self._thread.start()
        if not self.ready_flag.wait(timeout) or self.error is not None:
            self.stop()
            raise RuntimeError(f"the operator did not start: {self.error!r}")
        return self

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 20) -> None:
        self.stop_flag.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the operator thread did not stop in time")


class Kube:
    """The real kubernetes client, returning plain dicts (as kubectl -o json would)."""

    def __init__(self) -> None:
        self.api_client = kubernetes.client.ApiClient(kube.load_configuration())
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)
        self.apps = kubernetes.client.AppsV1Api(self.api_client)
        self.core = kubernetes.client.CoreV1Api(self.api_client)

    @staticmethod
    def _json(response: Any) -> Any:
        return raw_json(response)

    def _merge_patch(self, patch_method: Any, *args: Any) -> Any:
        """Call a ``patch_*`` method of the client with a JSON merge patch; the result as JSON."""
        return self._json(
            patch_method(*args, _content_type=kube.MERGE_PATCH, _preload_content=False)
        )

    # pools
    def create_pool(self, body: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
        return self._json(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, body, _preload_content=False
            )
        )

    def get_pool(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self._json(
            self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
            )
        )

    def patch_pool(self, name: str, patch: dict[str, Any], namespace: str = "default") -> Any:
        return self._merge_patch(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            patch,
        )

    def scale_pool(self, name: str, replicas: int, namespace: str = "default") -> Any:
        """What `kubectl scale ipool NAME --replicas N` (or an HPA) does: the scale subresource."""
        return self._merge_patch(
            self.custom.patch_namespaced_custom_object_scale,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            {"spec": {"replicas": replicas}},
        )

    def delete_pool(self, name: str, namespace: str = "default") -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
        )

    # children
    def deployments(self, namespace: str = "default") -> list[dict[str, Any]]:
        return self._json(self.apps.list_namespaced_deployment(namespace, _preload_content=False))[
            "items"
        ]

    def deployment(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return self._json(
            self.apps.read_namespaced_deployment(name, namespace, _preload_content=False)
        )

    def services(self, namespace: str = "default") -> list[dict[str, Any]]:
        return self._json(self.core.list_namespaced_service(namespace, _preload_content=False))[
            "items"
        ]

    def pods(self, namespace: str = "default") -> list[dict[str, Any]]:
        return self._json(self.core.list_namespaced_pod(namespace, _preload_content=False))["items"]

    def events(self, namespace: str = "default") -> list[dict[str, Any]]:
        return self._json(self.core.list_namespaced_event(namespace, _preload_content=False))[
            "items"
        ]

    # --- what the kubelet and the ReplicaSet controller would do (kmock has neither) ---------

    def start_pod(self, deployment: dict[str, Any], index: int, ip: str) -> str:
        """Create a pod of ``deployment`` (owned by it, its template's labels); not ready yet."""
        name = f"{deployment['metadata']['name']}-{index}"
        namespace = deployment["metadata"]["namespace"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": deployment["spec"]["template"]["metadata"]["labels"],
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": deployment["metadata"]["name"],
                        "uid": deployment["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": deployment["spec"]["template"]["spec"],
        }
        # A dict body: the client sends it as it is (its types say a V1Pod).
        self.core.create_namespaced_pod(namespace, pod, _preload_content=False)  # type: ignore[arg-type]
        self.set_pod_ready(name, namespace, ip=ip, ready=False)
        return name

    def set_pod_ready(self, name: str, namespace: str, *, ip: str, ready: bool) -> None:
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        }
        self._merge_patch(
            self.core.patch_namespaced_pod_status, name, namespace, {"status": status}
        )

    def set_pod_waiting(self, name: str, namespace: str, reason: str, message: str) -> None:
        status = {
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "restartCount": 3,
                    "image": "x",
                    "imageID": "",
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ]
        }
        self._merge_patch(
            self.core.patch_namespaced_pod_status, name, namespace, {"status": status}
        )

    def set_engine_exited(self, name: str, namespace: str, exit_code: int, message: str) -> None:
        """The engine container exited and waits to be restarted (what the kubelet reports with
        terminationMessagePolicy FallbackToLogsOnError: the log tail as the message)."""
        terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
        status = {
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "restartCount": 2,
                    "image": "x",
                    "imageID": "",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": terminated},
                }
            ]
        }
        self._merge_patch(
            self.core.patch_namespaced_pod_status, name, namespace, {"status": status}
        )

    def finish_rollout(self, name: str, namespace: str = "default") -> None:
        """Deployment status as the controller reports it once every pod is updated."""
        deployment = self.deployment(name, namespace)
        replicas = deployment["spec"]["replicas"]
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        self._merge_patch(
            self.apps.patch_namespaced_deployment_status, name, namespace, {"status": status}
        )
