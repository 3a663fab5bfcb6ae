"""A local "kubelet" for the operator tests: runs a Deployment's engine container as a process.

It also plays the EndpointSlice controller (kmock has none): the slice of each pool's Service
lists the pods with their readiness, as Kubernetes would, for the gateway's discovery.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes.client

from slotserve.operator import kube as kube_io
from slotserve.operator.builders import ENGINE_PORT, ENGINE_PORT_NAME
from tests.operator.operator_harness import Kube
from tests.support import http_ok

NAMESPACE = "default"


def write_endpoint_slice(kube: Kube, service: str, endpoints: list[tuple[str, str, bool]]) -> None:
    """Create or replace the EndpointSlice of ``service``: (pod name, IP, ready) each."""
    api = kubernetes.client.DiscoveryV1Api(kube.api_client)
    live = kube._json(kube.core.read_namespaced_service(service, NAMESPACE, _preload_content=False))
    body: dict[str, Any] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-slice",
            "namespace": NAMESPACE,
            # The controller copies the Service's labels and adds the service-name label.
            "labels": {
                **(live["metadata"].get("labels") or {}),
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": ENGINE_PORT_NAME, "port": ENGINE_PORT, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {"kind": "Pod", "name": name, "namespace": NAMESPACE},
            }
            for name, ip, ready in endpoints
        ],
    }
    try:
        api.read_namespaced_endpoint_slice(body["metadata"]["name"], NAMESPACE)
    except kubernetes.client.exceptions.ApiException as error:
        if error.status != 404:
            raise
        # A dict body: the client sends it as it is (its types say a V1EndpointSlice).
        api.create_namespaced_endpoint_slice(NAMESPACE, body, _preload_content=False)  # type: ignore[arg-type]
        return
    api.patch_namespaced_endpoint_slice(
        body["metadata"]["name"],
        NAMESPACE,
        body,
        _content_type=kube_io.MERGE_PATCH,
        _preload_content=False,
    )


class LocalKubelet:
    """Runs a Deployment's engine container as a local process, as a kubelet would run a pod.

    No containers here: the container's command and args run with this Python, volume mounts
    map to host folders (hostPath volumes to their path, emptyDirs to fresh folders), the pod
    gets its own loopback address (127.x.y.z) so every engine can listen on the contract's
    port 8000, and ``sync()`` plays the readiness probe, writing the pod's Ready condition.
    """

    def __init__(self, kube: Kube, workdir: Path) -> None:
        self.kube = kube
        self.workdir = workdir
        self.pods: dict[str, tuple[subprocess.Popen[bytes], str, str, bool]] = {}
        self._slices_written = False

    def run_pod(self, deployment: dict[str, Any], index: int, ip: str) -> str:
        name = self.kube.start_pod(deployment, index, ip)
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        mounts: dict[str, str] = {}
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                mounts[mount["mountPath"]] = volume["hostPath"]["path"]
            else:
                folder = self.workdir / name / mount["name"]
                folder.mkdir(parents=True)
                mounts[mount["mountPath"]] = str(folder)

        def local(value: str) -> str:
            for path in sorted(mounts, key=len, reverse=True):
                if value == path or value.startswith(path + "/"):
                    return mounts[path] + value[len(path) :]
            return value

        args = [local(arg) for arg in container["args"]]
        args[args.index("--host") + 1] = ip
        env = {**os.environ}
        env.update({var["name"]: local(var["value"]) for var in container["env"] if "value" in var})
        log = (self.workdir / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "slotserve.cli", *args], env=env, stdout=log, stderr=log
        )
        probe = container["readinessProbe"]["httpGet"]["path"]
        self.pods[name] = (process, ip, probe, False)
        return name

    def sync(self) -> bool:
        """Probe every pod once, update its Ready condition when it changed; all ready?

        Then play the EndpointSlice controller too: one slice per Service (the pool's), listing
        its pods with their readiness, which is where the gateway finds engines.
        """
        changed = False
        for name, (process, ip, probe, was_ready) in list(self.pods.items()):
            ready = process.poll() is None and http_ok(f"http://{ip}:8000{probe}")
            if ready != was_ready:
                self.kube.set_pod_ready(name, NAMESPACE, ip=ip, ready=ready)
                self.pods[name] = (process, ip, probe, ready)
                changed = True
        if changed or not self._slices_written:
            for service in {name.rsplit("-", 1)[0] for name in self.pods}:
                endpoints = [
                    (name, ip, ready)
                    for name, (_, ip, _, ready) in self.pods.items()
                    if name.rsplit("-", 1)[0] == service
                ]
                write_endpoint_slice(self.kube, service, endpoints)
            self._slices_written = True
        return all(ready for _, _, _, ready in self.pods.values())

    def kill(self, name: str) -> None:
        process = self.pods[name][0]
        process.kill()
        process.wait(10)

    def stop(self) -> None:
        for process, _, _, _ in self.pods.values():
            if process.poll() is None:
                process.terminate()
        for process, _, _, _ in self.pods.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def free_loopback_ips(count: int, port: int = 8000) -> list[str]:
    """Loopback addresses where ``port`` is free (a pod IP each); fewer if the port is taken."""
    found: list[str] = []
    for _ in range(50):
        ip = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}.{random.randint(1, 254)}"
        with socket.socket() as sock:
            try:
                sock.bind((ip, port))
            except OSError:
                continue
        found.append(ip)
        if len(found) == count:
            break
    return found
