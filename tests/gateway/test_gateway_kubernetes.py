"""Kubernetes discovery end to end: a gateway process watches InferencePools and the
EndpointSlices of their Services on an API server (the emulator of tests/kubeapi, with
the real CRD) and routes only to ready, not terminating, pods that the pool's Service selects.

Every engine here is a real HTTP engine double. The decoy listens at the address written into
the pool's ``status.endpoints`` (which anyone allowed to patch ``inferencepools/status`` can
write) and in the slice of another Service: it is never contacted, not even polled.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.gateway.endpointslice_support import Pod, sync_slices
from tests.gateway.gateway_support import SLOTSERVE, Proc
from tests.kubeapi import ApiServerThread
from tests.support import free_port, http_ok, wait_until

kubernetes = pytest.importorskip("kubernetes")

from slotserve.gateway.pools.discovery import REQUIRED_RULES, USER_AGENT  # noqa: E402
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


def served_by(gateway: Proc, engines: dict) -> str:
    """Send one completion; the name of the engine that answered it ("" if none did)."""
    before = {name: engine.stats()["num_requests"] for name, engine in engines.items()}
    status, _ = post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "hi"})
    after = {name: engine.stats()["num_requests"] for name, engine in engines.items()}
    answered = [name for name in engines if after[name] > before[name]]
    return answered[0] if status == 200 and len(answered) == 1 else ""


def refused(gateway: Proc) -> tuple[int, str]:
    status, body = post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "x"})
    return status, (body.get("error") or {}).get("code", "")


def within(seconds: float, condition) -> float:
    """How long ``condition`` took to hold (polled every 20 ms); fails past ``seconds``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, "no change in time"
        time.sleep(0.02)
    return time.monotonic() - started


def gateway_calls_allowed(server) -> set[tuple[str, str, str, str]]:
    """Every API call the gateway made, each checked against its declared RBAC rules."""
    made = {call[1:] for call in server.calls if call[0] == USER_AGENT}
    for verb, group, resource, _ in made:
        assert any(
            group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            for rule in REQUIRED_RULES
        ), f"the gateway called {verb} {group}/{resource}, which its RBAC rules do not allow"
    return made


def test_routes_only_to_ready_pods_of_the_pools_service(spawn, tmp_path):
    server = ApiServerThread([crd.build_crd()]).start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())
        api_client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        api = kubernetes.client.CustomObjectsApi(api_client)
        engines = {name: spawn.double(slots=2, delay=0.01, model="m") for name in ("a", "b")}
        decoy = spawn.double(slots=64, delay=0.01, model="m")

        pool = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
        pool["metadata"] = {"name": "small", "namespace": "ml"}
        pool["spec"]["model"]["name"] = "m"
        api.create_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, pool)
        steer = {"status": {"endpoints": [decoy.url.removeprefix("http://")]}}
        api.patch_namespaced_custom_object_status(GROUP, VERSION, "ml", PLURAL, "small", steer)
        # The decoy is a pod of another Service in the same namespace: selected, but not by
        # the pool's Service.
        sync_slices(api_client, "ml", "other", [Pod(decoy.url, "other-1")])
        a, b = Pod(engines["a"].url, "small-1"), Pod(engines["b"].url, "small-2", ready=False)
        sync_slices(api_client, "ml", "small", [a, b])
        sync_slices(api_client, "ml", "idle", [])  # a placeholder slice (endpoints null) is listed

        port = free_port()
        argv = [str(SLOTSERVE), "gateway", "--discovery", "kubernetes", "--namespaces", "ml"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
        argv += ["--no-hold-at-zero"]  # a pool left without pods is refused at once
        gateway = spawn._start(Proc, "gateway", argv, port, {"KUBECONFIG": str(kubeconfig)})
        wait_until(lambda: http_ok(f"{gateway.url}/ready"), 20, what="gateway ready")
        assert models(gateway.url) == ["m"]
        # Ready: the only ready pod of the Service serves; b (not ready) and the decoy do not.
        assert {served_by(gateway, engines) for _ in range(6)} == {"a"}

        # b turns ready while a starts terminating (serving, but no new work): one watch event.
        sync_slices(
            api_client, "ml", "small", [Pod(a.url, a.name, terminating=True), Pod(b.url, b.name)]
        )
        switch_s = within(10, lambda: served_by(gateway, engines) == "b")
        assert {served_by(gateway, engines) for _ in range(6)} == {"b"}
        num_on_a = engines["a"].stats()["num_requests"]

        # Patching the status again (after start) changes nothing either.
        api.patch_namespaced_custom_object_status(GROUP, VERSION, "ml", PLURAL, "small", steer)
        assert {served_by(gateway, engines) for _ in range(6)} == {"b"}

        # No pod left (the controller keeps a placeholder slice, endpoints null): 503 at once.
        sync_slices(api_client, "ml", "small", [])
        empty_s = within(
            10,
            lambda: refused(gateway) == (503, "no_ready_endpoint"),
        )
        assert engines["a"].stats()["num_requests"] == num_on_a
        decoy_stats = decoy.stats()
        assert decoy_stats["num_requests"] == 0 and decoy_stats["num_load_polls"] == 0
        print(
            f"\nslice change -> routed to the newly ready pod: {switch_s * 1000:.0f} ms; "
            f"-> 503 with no pod left: {empty_s * 1000:.0f} ms"
        )

        api.delete_namespaced_custom_object(GROUP, VERSION, "ml", PLURAL, "small")
        wait_until(lambda: models(gateway.url) == [], 15, what="pool removed")
        status, body = post(f"{gateway.url}/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 404 and "not served" in body["error"]["message"]

        assert server.server is not None
        made = gateway_calls_allowed(server.server)
        # One list of slices, then one watch throughout: no event (a null endpoints list
        # included) ever broke the watch and forced a re-list.
        slice_lists = [
            call
            for call in server.server.calls
            if call[:2] == (USER_AGENT, "list") and call[3] == "endpointslices"
        ]
        assert len(slice_lists) == 1
        assert (
            "list",
            "discovery.k8s.io",
            "endpointslices",
            "kubernetes.io/service-name,slotserve.dev/pool",
        ) in made
        assert {verb for verb, _, resource, _ in made if resource == "endpointslices"} == {
            "list",
            "watch",
        }
    finally:
        server.stop()
