"""Kubernetes discovery end to end: a gateway process watches InferencePools on an API server
(the operator suite's kmock-based server, with the real CRD) and routes to status.endpoints."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from gateway_support import SLOTSERVE, Proc
from support import free_port, http_ok, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
kubernetes = pytest.importorskip("kubernetes")
operator_harness = pytest.importorskip("operator_harness")  # the operator suite's API server

from slotserve.operator import crd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "slotserve.dev", "v1alpha1", "inferencepools"


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def models(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def test_gateway_follows_inference_pools(spawn, tmp_path):
    server = operator_harness.ApiServerThread([crd.build_crd()]).start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        api = kubernetes.client.CustomObjectsApi(
            kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        )
        engine = spawn.double(slots=2, delay=0.01, model="m")
        port = free_port()
        argv = [str(SLOTSERVE), "gateway", "--discovery", "kubernetes", "--namespaces", "ml"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
        gateway = spawn._start(Proc, "gateway", argv, port, {"KUBECONFIG": str(kubeconfig)})
        wait_until(lambda: http_ok(f"{gateway.url}/health"), 20, what="gateway")

        pool = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
        pool["metadata"] = {"name": "small", "namespace": "ml"}
        pool["spec"]["model"]["name"] = "m"
        api.create_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, pool)
        address = engine.url.removeprefix("http://")
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, "ml", PLURAL, "small", {"status": {"endpoints": [address]}}
        )
        wait_until(lambda: models(gateway.url) == ["m"], 15, what="pool discovered")
        deadline = time.monotonic() + 10
        status = 0
        while status != 200 and time.monotonic() < deadline:  # until /load was read once
            status, body = post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "hi"})
            time.sleep(0.1)
        assert status == 200, body
        assert engine.stats()["arrivals"][-1] == "hi"

        # No ready endpoint any more: 503 at once; the object gone: 404.
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, "ml", PLURAL, "small", {"status": {"endpoints": []}}
        )
        wait_until(
            lambda: post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "x"})[0] == 503,
            15,
            what="endpoints removed",
        )
        api.delete_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, "small")
        wait_until(lambda: models(gateway.url) == [], 15, what="pool removed")
        status, body = post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 404 and "not served" in body["error"]["message"]
    finally:
        server.stop()
