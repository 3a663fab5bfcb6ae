"""status.admission follows real traffic: two real gateway processes share a real Redis in front
of an engine double; the operator (real kopf, on the API emulator) reads the same Redis.

What a user would notice: ``kubectl get ipool`` shows QUEUED and IN-FLIGHT as the load comes and
goes, the Saturated condition and its Warning/Normal events follow, status writes stay few under
steady load, and a Redis the operator cannot reach leaves the numbers stale with Saturated
Unknown while the pool's children are still reconciled.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis

from slotserve.admission_stats import WINDOW_TTL_S
from slotserve.contracts.crd import API_VERSION, KIND
from slotserve.gateway.admission.window import FLUSH_INTERVAL_S
from slotserve.operator import kube as kube_io
from slotserve.operator.settings import OperatorSettings
from tests.gateway.gateway_support import Spawner, pool, write_pools
from tests.kubeapi import ApiServerThread
from tests.operator.operator_harness import Kube, redis_operator_settings
from tests.support import RedisServer, free_port, wait_until

pytestmark = pytest.mark.slow
MODEL = "chat"
SLOTS = 2


@pytest.fixture
def operator_settings(redis_server: RedisServer) -> OperatorSettings:
    return redis_operator_settings(redis_server.url, admission_max_age_seconds=60)


def create_pool(kube: Kube, name: str = "chat", **spec: Any) -> None:
    kube.create_pool(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name},
            "spec": {
                "model": {"name": MODEL, "source": {"builtin": "smollm2"}},
                "replicas": 1,
                "batching": {"maxBatchSize": SLOTS},
                **spec,
            },
        }
    )


def serve_one_pod(kube: Kube, name: str = "chat") -> None:
    wait_until(lambda: kube.deployments(), 15, what="deployment")
    pod = kube.start_pod(kube.deployment(name), 0, "10.0.0.5")
    kube.set_pod_ready(pod, "default", ip="10.0.0.5", ready=True)


def admission(kube: Kube, name: str = "chat") -> dict[str, Any]:
    return (kube.get_pool(name).get("status") or {}).get("admission") or {}


def condition(kube: Kube, kind: str, name: str = "chat") -> dict[str, Any]:
    conditions = (kube.get_pool(name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def status_writes(apiserver: ApiServerThread) -> int:
    assert apiserver.server is not None  # started
    return sum(
        1
        for agent, verb, _, plural, _ in apiserver.server.calls
        if agent.startswith(kube_io.USER_AGENT) and verb == "patch" and plural.endswith("/status")
    )


class Load:
    """``clients`` closed-loop clients spread over the gateways, until stopped."""

    def __init__(self, gateways: list[str], clients: int, delay_s: float) -> None:
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._body = json.dumps(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, "x_delay": delay_s}
        ).encode()
        self._threads = [
            threading.Thread(target=self._client, args=(gateways[i % len(gateways)],), daemon=True)
            for i in range(clients)
        ]

    def _client(self, url: str) -> None:
        while not self._stop.is_set():
            request = urllib.request.Request(
                f"{url}/v1/completions", self._body, {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    self.statuses.append(response.status)
            except urllib.error.HTTPError as error:
                self.statuses.append(error.code)
                time.sleep(0.2)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(70)


@pytest.mark.usefixtures("operator")
def test_status_admission_follows_the_traffic_with_few_writes(
    kube: Kube, apiserver: ApiServerThread, redis_server: RedisServer, spawn: Spawner, tmp_path
):
    double = spawn.double(slots=SLOTS, delay=0.05, model=MODEL)
    pools = write_pools(tmp_path / "pools.yaml", [pool(MODEL, [double.url])])
    gateways = [spawn.gateway(pools, redis_url=redis_server.url).url for _ in range(2)]
    create_pool(kube)
    serve_one_pod(kube)
    wait_until(
        lambda: admission(kube).get("slotsTotal") == SLOTS, 15, what="status.admission appears"
    )
    assert admission(kube)["queued"] == 0 and admission(kube)["saturated"] is False
    assert condition(kube, "Saturated")["status"] == "False"

    # 8 clients, 2 slots, 1 s per request: 2 in flight, ~6 waiting across both gateways.
    with Load(gateways, clients=8, delay_s=1.0) as load:
        wait_until(
            lambda: admission(kube).get("queued", 0) >= 3 and admission(kube)["inFlight"] == SLOTS,
            20,
            what="queued and in-flight in status.admission",
        )
        saturated = condition(kube, "Saturated")
        assert (saturated["status"], saturated["reason"]) == ("True", "SlotsFull")
        assert admission(kube)["saturated"] is True
        # Steady load: the numbers barely move, so the operator writes rarely.
        writes_before, started = status_writes(apiserver), time.monotonic()
        time.sleep(15)
        writes = status_writes(apiserver) - writes_before
        elapsed = time.monotonic() - started
    refreshes = elapsed / 0.5
    print(f"steady load: {writes} status writes in {elapsed:.1f} s ({refreshes:.0f} refreshes)")
    assert writes <= refreshes / 3, f"{writes} writes in {refreshes:.0f} refreshes"
    assert 200 in load.statuses

    wait_until(
        lambda: admission(kube).get("queued") == 0 and admission(kube)["inFlight"] == 0,
        15,
        what="the queue drains in status.admission",
    )
    wait_until(
        lambda: condition(kube, "Saturated").get("status") == "False", 10, what="unsaturated"
    )
    status = admission(kube)
    assert status["admittedPerMinute"] >= 8
    assert status["queueWaitSecondsP95"] > 0.5  # most waited behind two 1 s requests
    # No keys file: every request is the default tenant's, listed with its own numbers.
    assert set(status["tenants"]) == {"default"}
    assert status["tenants"]["default"]["admittedPerMinute"] == status["admittedPerMinute"]
    wanted = {("Warning", "Saturated"), ("Normal", "Unsaturated")}
    wait_until(
        lambda: wanted <= {(e["type"], e["reason"]) for e in kube.events()},
        5,
        what="Saturated and Unsaturated events",
    )

    # Idle: nothing moves but the last minute's rate, so nothing else is written (until
    # admission_max_age_seconds). The gateways flush their last counts up to FLUSH_INTERVAL_S
    # after the queue drains, and the operator publishes them at its next refresh: idle starts
    # once the published rate has settled. The rate then decays as its windows age out (the
    # current window's elapsed time scales it down, and at each boundary a window drops out and
    # the scale resets): a move past the write threshold is news, so one or two writes may land
    # in the 4 s (the suite's load once stretched the settling until one did), for the rate alone.
    last_rate: list[int] = []

    def rate_settled() -> bool:
        last_rate.append(admission(kube)["admittedPerMinute"])
        return len(last_rate) > 1 and last_rate[-1] == last_rate[-2]

    wait_until(rate_settled, 20, interval=FLUSH_INTERVAL_S + 1.0, what="the published rate settles")
    idle_before, rate_before = status_writes(apiserver), last_rate[-1]
    time.sleep(4)
    idle_writes = status_writes(apiserver) - idle_before
    after = admission(kube)
    rate_after = after["admittedPerMinute"]
    print(f"idle: {idle_writes} status writes in 4 s, rate {rate_before} -> {rate_after}")
    assert (after["queued"], after["inFlight"], after["saturated"]) == (0, 0, False)
    if idle_writes:
        assert idle_writes <= 2 and rate_after != rate_before, (idle_writes, after)


@pytest.mark.usefixtures("operator")
def test_full_queue_rejections_by_reason(
    kube: Kube, redis_server: RedisServer, spawn: Spawner, tmp_path
):
    double = spawn.double(slots=SLOTS, delay=0.05, model=MODEL)
    pools = write_pools(tmp_path / "pools.yaml", [pool(MODEL, [double.url], maxQueueSize=1)])
    gateway = spawn.gateway(pools, redis_url=redis_server.url).url
    create_pool(kube)
    serve_one_pod(kube)
    with Load([gateway], clients=8, delay_s=1.0) as load:
        wait_until(
            lambda: admission(kube).get("rejectedPerMinute", {}).get("queue_full", 0) > 0,
            20,
            what="queue_full rejections in status.admission",
        )
    assert 429 in load.statuses
    assert condition(kube, "Saturated")["reason"] in {"QueueFull", "SlotsFull"}
    # What the gateways wrote for it: prefixed window hashes that expire on their own.
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    windows = list(client.scan_iter(match="slotserve:{chat}:window:*"))
    assert windows
    for key in windows:
        assert 0 < client.ttl(key) <= WINDOW_TTL_S
        assert client.hget(key, "admitted") is not None or client.hget(key, "rejected:queue_full")
    client.close()


def test_unreachable_redis_leaves_admission_stale_and_children_reconciled(
    kube: Kube, apiserver: ApiServerThread, tmp_path
):
    from tests.operator.operator_harness import OperatorThread

    redis = RedisServer(tmp_path / "redis")
    redis.start()
    settings = OperatorSettings(
        engine_image="registry.test/slotserve/engine:test",
        health_port=free_port(),
        redis_url=redis.url,
        admission_refresh_seconds=0.3,
    )
    operator = OperatorThread(settings).start()
    try:
        create_pool(kube)
        serve_one_pod(kube)
        wait_until(lambda: admission(kube).get("slotsTotal") == SLOTS, 15, what="admission")
        seen = admission(kube)["observedTime"]
        redis.stop()
        wait_until(
            lambda: condition(kube, "Saturated").get("status") == "Unknown",
            15,
            what="Saturated Unknown",
        )
        assert condition(kube, "Saturated")["reason"] == "AdmissionUnavailable"
        assert admission(kube)["observedTime"] == seen  # stale, not invented
        # Children are still reconciled: a spec change reaches the Deployment.
        kube.patch_pool("chat", {"spec": {"replicas": 3}})
        wait_until(lambda: kube.deployment("chat")["spec"]["replicas"] == 3, 15, what="reconciled")
        # observedTime has a one-second resolution: a recovery within the same second as the
        # last reading would write the same string, so let the clock pass that second first.
        wait_until(lambda: _utc_second() != seen, 3, what="the next second")
        redis.start()
        wait_until(
            lambda: condition(kube, "Saturated").get("status") == "False",
            15,
            what="Redis back: Saturated False",
        )
        assert admission(kube)["observedTime"] != seen
    finally:
        operator.stop()
        redis.stop()


@pytest.mark.usefixtures("operator")
def test_only_the_pool_that_owns_the_model_name_reports_its_queue(kube: Kube):
    create_pool(kube, name="chat")
    serve_one_pod(kube, "chat")
    wait_until(lambda: admission(kube, "chat").get("slotsTotal") == SLOTS, 15, what="admission")
    time.sleep(0.5)
    create_pool(kube, name="chat-copy")  # same model name, younger: ModelNameConflict
    wait_until(
        lambda: condition(kube, "Degraded", "chat-copy").get("reason") == "ModelNameConflict",
        15,
        what="the younger pool loses the name",
    )
    time.sleep(1.5)  # three refreshes
    assert admission(kube, "chat-copy") == {}  # the gateways' queue of "chat" is not its own
    assert condition(kube, "Saturated", "chat-copy") == {}


def _utc_second() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
