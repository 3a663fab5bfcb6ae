"""Scale from zero with the queue holding (API emulator, real kopf, real Redis, real gateway).

The operator measures each engine pod's creation -> Ready and keeps the longest of the last few
in ``status.coldStartSeconds`` (what the gateways use as the Retry-After of requests held for a
pool at zero); the built-in scaler wakes a pool at zero on the first *held* request, before it
times out and without waiting for its scale-up window.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from slotserve.operator.autoscaler import ScalePolicy, Stabilizer, recommend
from slotserve.operator.cold_start import ColdStarts, ready_after_seconds
from slotserve.operator.settings import OperatorSettings
from tests.gateway.gateway_support import DOUBLE, Proc, Spawner, pool, write_pools
from tests.operator.operator_harness import Kube, redis_operator_settings
from tests.operator.test_operator_admission import admission, create_pool
from tests.support import RedisServer, free_port, http_ok, wait_until

MODEL = "chat"


# -- pure: the measurement and the wake ------------------------------------------------------


def pod_body(created: str, ready_at: str | None) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "False"}]
    if ready_at is not None:
        conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": ready_at}]
    return {"metadata": {"creationTimestamp": created}, "status": {"conditions": conditions}}


def test_ready_after_is_creation_to_the_ready_transition():
    assert ready_after_seconds(pod_body("2026-01-01T10:00:00Z", "2026-01-01T10:00:42Z")) == 42
    assert ready_after_seconds(pod_body("2026-01-01T10:00:00Z", None)) is None
    assert ready_after_seconds(pod_body("2026-01-01T10:00:09Z", "2026-01-01T10:00:00Z")) is None
    assert ready_after_seconds({"metadata": {}, "status": {}}) is None


def test_only_pods_seen_starting_are_measured_and_the_longest_recent_one_is_kept():
    starts, key = ColdStarts(), ("default", "chat")
    assert starts.observe(key, [("a", None), ("old", 99.0)]) is None  # "old": Ready before
    assert starts.observe(key, [("a", 7.0), ("old", 99.0)]) == 7.0
    assert starts.observe(key, [("a", 7.0), ("b", None)]) == 7.0
    assert starts.observe(key, [("a", None), ("b", 12.0)]) == 12.0  # a lost readiness
    assert starts.observe(key, [("a", 3600.0), ("b", 12.0)]) == 12.0  # ... not a cold start
    for i in range(5):  # newer starts push the old ones out
        assert starts.observe(key, [(f"n{i}", None)]) is not None
        starts.observe(key, [(f"n{i}", 5.0)])
    assert starts.observe(key, []) == 5.0
    # After a restart the status value is the first sample.
    assert ColdStarts().observe(key, [], previous=30) == 30.0
    assert ColdStarts().observe(key, [], previous="30") is None


def test_waking_from_zero_skips_the_scale_up_window():
    policy = ScalePolicy(min_replicas=0, max_replicas=5, target=2, up_window_s=60, down_window_s=0)
    stabilizer = Stabilizer()
    assert stabilizer.desired(0, 0, 0, policy) == 0
    assert stabilizer.desired(1, recommend(5, policy), 0, policy) == 1  # at once, and only 1
    assert stabilizer.desired(2, recommend(5, policy), 1, policy) == 1  # the rest: the window
    assert stabilizer.desired(62, recommend(5, policy), 1, policy) == 3


# -- on the API emulator ---------------------------------------------------------------------


@pytest.fixture
def operator_settings(redis_server: RedisServer) -> OperatorSettings:
    return redis_operator_settings(redis_server.url)


def status(kube: Kube) -> dict[str, Any]:
    return kube.get_pool(MODEL).get("status") or {}


def become_ready(kube: Kube, pod: str, ip: str, after_s: float, ready: bool = True) -> None:
    """What the kubelet writes: Ready, with its transition ``after_s`` after the pod's creation."""
    metadata = kube.core.read_namespaced_pod(pod, "default").metadata
    assert metadata is not None and isinstance(metadata.creation_timestamp, datetime.datetime)
    at = (metadata.creation_timestamp + datetime.timedelta(seconds=after_s)).astimezone(
        datetime.UTC
    )
    ready_condition = {
        "type": "Ready",
        "status": "True" if ready else "False",
        "lastTransitionTime": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    body = {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "PodScheduled", "status": "True"}, ready_condition],
        }
    }
    kube._merge_patch(kube.core.patch_namespaced_pod_status, pod, "default", body)


@pytest.mark.usefixtures("operator")
def test_cold_start_is_measured_and_kept_in_status(kube: Kube):
    create_pool(kube, replicas=2)
    wait_until(lambda: kube.deployments(), 15, what="deployment")
    first = kube.start_pod(kube.deployment(MODEL), 0, "10.0.0.5")
    second = kube.start_pod(kube.deployment(MODEL), 1, "10.0.0.6")
    wait_until(lambda: status(kube).get("replicas") == 2, 10, what="both pods seen starting")
    assert "coldStartSeconds" not in status(kube)  # nothing measured yet

    become_ready(kube, first, "10.0.0.5", after_s=7)
    wait_until(lambda: status(kube).get("coldStartSeconds") == 7.0, 10, what="7 s measured")
    become_ready(kube, second, "10.0.0.6", after_s=12)
    wait_until(lambda: status(kube).get("coldStartSeconds") == 12.0, 10, what="the longer one")

    # Readiness lost and regained an hour later is not a cold start.
    become_ready(kube, first, "10.0.0.5", after_s=3000, ready=False)
    wait_until(lambda: status(kube).get("readyReplicas") == 1, 10, what="one ready")
    become_ready(kube, first, "10.0.0.5", after_s=3600)
    wait_until(lambda: status(kube).get("readyReplicas") == 2, 10, what="both ready again")
    assert status(kube)["coldStartSeconds"] == 12.0


def start_double(spawn: Spawner, port: int) -> Proc:
    argv = [sys.executable, str(DOUBLE), "--port", str(port), "--slots", "2"]
    argv += ["--delay", "0.05", "--model", MODEL]
    proc = spawn._start(Proc, "double", argv, port)
    wait_until(lambda: http_ok(f"{proc.url}/health"), 15, what="engine double")
    return proc


class HeldRequest(threading.Thread):
    """One completion request, in the background: its status once answered."""

    def __init__(self, gateway: str) -> None:
        super().__init__(daemon=True)
        self.gateway = gateway
        self.status: int | None = None

    def run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"{self.gateway}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                self.status = int(response.status)
        except urllib.error.HTTPError as error:
            self.status = int(error.code)


@pytest.mark.slow
@pytest.mark.usefixtures("operator")
def test_the_first_held_request_wakes_a_pool_at_zero_and_is_served(
    kube: Kube, redis_server: RedisServer, spawn: Spawner, tmp_path: Path
):
    port = free_port()  # the engine's address; nothing answers there yet
    pools_file = write_pools(tmp_path / "pools.yaml", [pool(MODEL, [f"http://127.0.0.1:{port}"])])
    gateway = spawn.gateway(pools_file, redis_server.url).url  # holding on: the default
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 3,
        "targetRequestsPerReplica": 2,
        "scaleUpWindowSeconds": 60,  # waking from zero does not wait for it
    }
    create_pool(kube, replicas=0, autoscaling=autoscaling)
    wait_until(lambda: kube.deployments(), 15, what="deployment")
    time.sleep(1)
    assert kube.get_pool(MODEL)["spec"]["replicas"] == 0  # no demand: stays at zero

    held = HeldRequest(gateway)
    started = time.monotonic()
    held.start()
    wait_until(lambda: kube.get_pool(MODEL)["spec"]["replicas"] == 1, 10, what="0 -> 1")
    woke_s = time.monotonic() - started
    assert held.is_alive()  # still held: neither refused nor timed out
    wait_until(lambda: admission(kube).get("queued") == 1, 10, what="queued in status")

    wait_until(lambda: kube.deployment(MODEL)["spec"]["replicas"] == 1, 10, what="deployment")
    pod = kube.start_pod(kube.deployment(MODEL), 0, "10.0.0.5")
    wait_until(lambda: status(kube).get("replicas") == 1, 10, what="the pod seen starting")
    start_double(spawn, port)  # the pod's engine is up: the gateway finds it at its next poll
    become_ready(kube, pod, "10.0.0.5", after_s=4)
    held.join(timeout=20)
    served_s = time.monotonic() - started
    assert held.status == 200
    wait_until(lambda: status(kube).get("coldStartSeconds") == 4.0, 10, what="cold start")
    print(f"held request: 0 -> 1 after {woke_s:.2f} s, served after {served_s:.2f} s")
    messages = [e["message"] for e in kube.events() if e["reason"] == "Scaled"]
    assert messages[0].startswith("0 -> 1 replicas: 1 requests queued"), messages
