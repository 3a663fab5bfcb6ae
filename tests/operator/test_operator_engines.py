"""A pool run by real engine processes: the operator's Deployment, executed by a local kubelet.

No cluster here: the API server is tests/kubeapi and ``LocalKubelet`` runs each pod's engine
container command (a tiny random Llama from a hostPath volume) as a process on its own loopback
address. What a user would notice: the pool turns Ready with one endpoint per engine, each
endpoint answers the OpenAI API with the pool's model name, the real gateway (Kubernetes
discovery) finds the pool and its engines (the kubelet also writes EndpointSlices) and serves it,
and an engine that dies leaves the endpoints at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from slotserve.contracts.crd import API_VERSION, KIND
from slotserve.operator.settings import OperatorSettings
from tests.operator.local_kubelet import LocalKubelet, free_loopback_ips
from tests.operator.operator_harness import Kube
from tests.support import free_port, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def operator_settings() -> OperatorSettings:
    """The local kubelet mounts the tiny model from a host folder: allowed here only."""
    return OperatorSettings(
        engine_image="registry.test/slotserve/engine:test",
        health_port=free_port(),
        allow_host_path=True,
    )


def http_get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bytes(response.read())
    except OSError:
        return b""


def complete(endpoint: str, model: str, *, retry: bool = False) -> Any:
    """A completion from ``endpoint``; with ``retry``, None on 503 (not ready yet)."""
    request = urllib.request.Request(
        f"http://{endpoint}/v1/completions",
        data=json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        if retry and error.code == 503:
            return None
        raise


@pytest.mark.usefixtures("operator")
def test_engines_from_the_built_deployment_serve_and_leave_endpoints_when_they_die(
    kube: Kube, tiny_model_dir: Path, tmp_path: Path
):
    ips = free_loopback_ips(2)
    if len(ips) < 2:
        pytest.skip("port 8000 is taken on every loopback address (something binds 0.0.0.0)")
    source = {"hostPath": {"path": str(tiny_model_dir)}}
    kube.create_pool(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": "tiny"},
            "spec": {
                "model": {"name": "tiny-chat", "source": source, "maxModelLen": 512},
                "replicas": 2,
                "batching": {"maxBatchSize": 4, "maxBatchedTokens": 256},
                "engine": {"drainTimeoutSeconds": 2},
            },
        }
    )
    wait_until(lambda: kube.deployments(), 15, what="deployment")
    kubelet = LocalKubelet(kube, tmp_path)
    try:
        deployment = kube.deployment("tiny")
        names = [kubelet.run_pod(deployment, index, ip) for index, ip in enumerate(ips)]
        wait_until(kubelet.sync, 120, interval=0.5, what="engines ready")

        def endpoints() -> list[str]:
            return (kube.get_pool("tiny").get("status") or {}).get("endpoints") or []

        expected = sorted(f"{ip}:8000" for ip in ips)
        wait_until(lambda: endpoints() == expected, 15, what="endpoints in the pool status")
        for endpoint in endpoints():
            answer = complete(endpoint, "tiny-chat")
            assert answer["model"] == "tiny-chat" and answer["choices"][0]["text"]

        # The real gateway, discovering the pool and its ready engines (EndpointSlices).
        port = free_port()
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "slotserve.cli",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--discovery",
                "kubernetes",
            ],
            env={**os.environ},  # KUBECONFIG: the emulator's (conftest)
            stdout=(tmp_path / "gateway.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(
                lambda: b"tiny-chat" in http_get(f"http://127.0.0.1:{port}/v1/models"),
                30,
                interval=0.3,
                what="gateway discovered the pool",
            )
            # The gateway checks the engines itself before routing (503 until then).
            answers: list[Any] = []

            def gateway_answers() -> bool:
                answers.append(complete(f"127.0.0.1:{port}", "tiny-chat", retry=True))
                return answers[-1] is not None

            wait_until(gateway_answers, 30, interval=0.5, what="a completion through the gateway")
            assert answers[-1]["choices"][0]["text"]
        finally:
            gateway.terminate()
            gateway.wait(20)

        kubelet.kill(names[0])  # kill -9: the readiness probe fails, the endpoint goes
        wait_until(
            lambda: (kubelet.sync(), endpoints() == [f"{ips[1]}:8000"])[1],
            15,
            interval=0.3,
            what="dead engine removed from the endpoints",
        )
        assert complete(f"{ips[1]}:8000", "tiny-chat")["choices"][0]["text"]
    finally:
        kubelet.stop()
