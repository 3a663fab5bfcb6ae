"""Discovery you can trust, end to end: gateway processes list and watch InferencePools on an API
server (the emulator of tests/kubeapi, with the real CRD), and the EndpointSlices of
their Services for the engines. /ready waits for the first lists; renames and deletes take
effect at once; every replica, fresh or long running, gives a contested model name to the same
(oldest) pool, and counts the conflict."""

from __future__ import annotations

import copy
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.gateway.endpointslice_support import Pod, sync_slices
from tests.gateway.gateway_support import SLOTSERVE, Proc
from tests.kubeapi import ApiServerThread
from tests.support import free_port, http_ok, wait_until

kubernetes = pytest.importorskip("kubernetes")

from slotserve.operator import crd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "slotserve.dev", "v1alpha1", "inferencepools"
MERGE_PATCH = "application/merge-patch+json"
BASE_POOL = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())


def get(url: str) -> tuple[int, Any]:
    """The status and the body: parsed JSON, or the text when it is not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as error:
        body, status = error.read(), error.code
    text = body.decode()
    return status, json.loads(text) if text.startswith("{") else text


def complete(url: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 1}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as error:
        return error.code


def models(url: str) -> list[str]:
    return [m["id"] for m in get(f"{url}/v1/models")[1]["data"]]


def conflicts_counted(url: str, model: str) -> float:
    text = get(f"{url}/metrics")[1]
    prefix = f'slotserve_gateway_pool_conflicts_total{{model="{model}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def start_gateway(spawn, kubeconfig: Path, *flags: str) -> Proc:
    port = free_port()
    argv = [str(SLOTSERVE), "gateway", "--discovery", "kubernetes", *flags]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    gateway = spawn._start(Proc, "gateway", argv, port, {"KUBECONFIG": str(kubeconfig)})
    wait_until(lambda: http_ok(f"{gateway.url}/health"), 20, what="gateway")
    return gateway


def make_pool(api, namespace: str, name: str, model: str, engine_url: str) -> None:
    """A pool and the EndpointSlice of its Service, with one ready engine pod."""
    body = copy.deepcopy(BASE_POOL)
    body["metadata"] = {"name": name, "namespace": namespace}
    body["spec"]["model"]["name"] = model
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    sync_slices(api.api_client, namespace, name, [Pod(engine_url, f"{name}-0")])


@pytest.fixture
def apiserver(tmp_path):
    server = ApiServerThread([crd.build_crd()]).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig())
    api = kubernetes.client.CustomObjectsApi(
        kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    )
    try:
        yield server, kubeconfig, api
    finally:
        server.stop()


def test_ready_stays_503_until_the_first_list(spawn, apiserver, tmp_path):
    server, real_kubeconfig, api = apiserver
    engine = spawn.double(slots=2, delay=0.01)
    make_pool(api, "ml", "small", "m", engine.url)
    # The gateway starts while the API server cannot be reached (a wrong address).
    kubeconfig = tmp_path / "gateway-kubeconfig"
    kubeconfig.write_text(
        server.kubeconfig().replace(server.url, f"http://127.0.0.1:{free_port()}")
    )
    gateway = start_gateway(spawn, kubeconfig)  # all namespaces
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        status, body = get(f"{gateway.url}/ready")
        assert status == 503 and body["pools_listed"] is False
        time.sleep(0.2)
    kubeconfig.write_text(real_kubeconfig.read_text())  # the API server becomes reachable
    wait_until(lambda: get(f"{gateway.url}/ready")[0] == 200, 20, what="ready after the list")
    # Ready means the pools are known and their engines polled: no 404, no 503 at this point.
    assert models(gateway.url) == ["m"]
    assert complete(gateway.url, "m") == 200


def test_renames_deletes_and_one_owner_on_every_replica(spawn, apiserver):
    _server, kubeconfig, api = apiserver
    old_engine, new_engine = spawn.double(slots=2, delay=0.01), spawn.double(slots=2, delay=0.01)
    make_pool(api, "b", "old", "other", old_engine.url)
    time.sleep(1.1)  # creationTimestamp has whole seconds: b/old is strictly older
    make_pool(api, "a", "new", "m", new_engine.url)
    first = start_gateway(spawn, kubeconfig, "--namespaces", "a,b")
    wait_until(lambda: get(f"{first.url}/ready")[0] == 200, 20, what="first replica ready")
    assert models(first.url) == ["m", "other"]

    # b/old (the older pool) is renamed to serve "m" too: "other" drops out at once, and "m"
    # moves to b/old's engine on the replica that saw a/new first ...
    patch = {"spec": {"model": {"name": "m"}}}
    api.patch_namespaced_custom_object(
        GROUP, VERSION, "b", PLURAL, "old", patch, _content_type=MERGE_PATCH
    )
    wait_until(lambda: models(first.url) == ["m"], 15, what="rename applied")
    # ... and on a replica started afterwards, which lists both at once.
    second = start_gateway(spawn, kubeconfig, "--namespaces", "a,b")
    wait_until(lambda: get(f"{second.url}/ready")[0] == 200, 20, what="second replica ready")
    for gateway in (first, second):
        before = old_engine.stats()["num_requests"]
        assert complete(gateway.url, "m") == 200
        assert old_engine.stats()["num_requests"] == before + 1
        assert conflicts_counted(gateway.url, "m") == 1
    assert new_engine.stats()["num_requests"] == 0

    # Deleting the owner hands the name to the remaining claimant on every replica.
    api.delete_namespaced_custom_object(GROUP, VERSION, "b", PLURAL, "old")
    for gateway in (first, second):
        served_before = new_engine.stats()["num_requests"]
        wait_until(
            lambda g=gateway, n=served_before: (
                complete(g.url, "m") == 200 and new_engine.stats()["num_requests"] > n
            ),
            15,
            what="owner deleted",
        )
    api.delete_namespaced_custom_object(GROUP, VERSION, "a", PLURAL, "new")
    for gateway in (first, second):
        wait_until(lambda g=gateway: models(g.url) == [], 15, what="all pools deleted")
        assert complete(gateway.url, "m") == 404
