"""A pool at zero (real processes): a request waits in the shared queue while no engine of its
pool is up, and is served once one answers; it times out with 503 + the cold start as
Retry-After when none comes; holding off refuses at once (503 ``no_ready_endpoint``).

The pools file names an endpoint whose engine is not started yet, as with ``slotserve up``
before the engines load or a pool scaled to zero; the engine (the double, or the real engine
with the tiny model) is started on that address after the request is queued.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.request

import aiohttp
import pytest

from slotserve.gateway.admission.types import QueueFullError, QueueTimeoutError
from slotserve.gateway.pools.cold_start import ColdStarts
from slotserve.gateway.pools.config import Pool
from slotserve.gateway.pools.discovery import pool_from_inference_pool
from slotserve.operator.admission_redis import AdmissionReader
from tests.gateway.gateway_support import DOUBLE, SLOTSERVE, Proc, pool, write_pools
from tests.gateway.test_gateway_admission_disconnects import write_and_close
from tests.support import free_port, http_ok, wait_until

MODEL = "m"
PAYLOAD = {"model": MODEL, "prompt": "x", "max_tokens": 2}
TIMEOUT = aiohttp.ClientTimeout(total=60)


def start_double(spawn, port: int) -> Proc:
    argv = [sys.executable, str(DOUBLE), "--port", str(port), "--slots", "2"]
    argv += ["--delay", "0.05", "--model", MODEL]
    proc = spawn._start(Proc, "double", argv, port)
    wait_until(lambda: http_ok(f"{proc.url}/health"), 15, what="engine double")
    return proc


def ready_at(url: str) -> float:
    """When (monotonic) the engine at ``url`` first answered ``/ready``."""
    wait_until(lambda: http_ok(f"{url}/ready"), 200, interval=0.05, what="engine /ready")
    return time.monotonic()


def queue_size(gateway: str, model: str = MODEL) -> float:
    """The gateway's own ``slotserve_gateway_queue_size`` for the pool (its /metrics)."""
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^slotserve_gateway_queue_size{{pool="{model}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def queued_in_redis(redis_url: str) -> int:
    """What the operator's scaler reads from the shared Redis."""
    reader = AdmissionReader(redis_url, prefix="slotserve")
    try:
        return (await reader.read([MODEL]))[MODEL].queued
    finally:
        await reader.close()


async def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def held_or_refused(gateway: str, answer: asyncio.Task) -> bool:
    """True once ``answer``'s request shows as held; False if it was refused as queue full."""
    deadline = time.monotonic() + 10
    while not answer.done():
        if await asyncio.to_thread(queue_size, gateway) >= 1:
            # The one held may still be the client that left, with this one about to be refused.
            await asyncio.sleep(0.3)
            if not answer.done():
                return True
            break
        assert time.monotonic() < deadline, "neither held nor refused"
        await asyncio.sleep(0.05)
    async with answer.result() as response:
        body = await response.json()
    assert (response.status, body["error"]["code"]) == (429, "queue_full"), body
    return False


def gateway_at_zero(spawn, tmp_path, request, backend: str, *extra: str, **admission):
    """A gateway whose pool's only endpoint is a free port: nothing is up there yet."""
    port = free_port()
    pools = write_pools(
        tmp_path / "pools.yaml",
        [{**pool(MODEL, [f"http://127.0.0.1:{port}"], **admission), "coldStartSeconds": 20}],
    )
    redis_url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    return spawn.gateway(pools, redis_url, extra=list(extra)), port, redis_url


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_held_request_is_served_once_an_engine_appears(spawn, tmp_path, request, backend):
    gateway, port, redis_url = gateway_at_zero(spawn, tmp_path, request, backend)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = time.monotonic()
        answer = asyncio.create_task(session.post(f"{gateway.url}/v1/completions", json=PAYLOAD))

        async def visible() -> bool:
            assert not answer.done(), "answered before any engine was up"
            if redis_url is not None and await queued_in_redis(redis_url) < 1:
                return False
            return queue_size(gateway.url) >= 1

        await wait_for(visible, 10, "the held request to show as queued")
        await asyncio.sleep(1.0)  # held, not refused, however long the engine takes
        assert not answer.done()
        engine_started = time.monotonic()
        await asyncio.to_thread(start_double, spawn, port)
        up_s = time.monotonic() - engine_started
        response = await asyncio.wait_for(answer, 15)
        async with response:
            body = await response.json()
        served_s = time.monotonic() - engine_started
        assert response.status == 200, body
        assert body["choices"], body
    print(
        f"{backend}: held {engine_started - started:.2f} s; engine up in {up_s:.2f} s; "
        f"answered {served_s:.2f} s after its start ({served_s - up_s:.2f} s after /health)"
    )
    assert served_s - up_s < 3.0  # the next /load poll and tick, not a queue timeout
    assert queue_size(gateway.url) == 0


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_held_request_times_out_with_the_cold_start_as_retry_after(
    spawn, tmp_path, request, backend
):
    gateway, _, _ = gateway_at_zero(spawn, tmp_path, request, backend, queueTimeoutSeconds=2)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = time.monotonic()
        async with session.post(f"{gateway.url}/v1/completions", json=PAYLOAD) as response:
            body = await response.json()
        waited_s = time.monotonic() - started
    assert response.status == 503, body
    assert body["error"]["code"] == "cold_start_timeout", body
    assert "became ready" in body["error"]["message"]
    retry_after = int(response.headers["Retry-After"])
    print(f"{backend}: 503 after {waited_s:.2f} s, Retry-After {retry_after} s: {body}")
    assert 1.9 <= waited_s < 5.0  # the pool's queue timeout, not at once
    assert 17 <= retry_after <= 19  # the pool's 20 s cold start, less the 2 s already waited


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_client_that_leaves_while_held_frees_its_place(spawn, tmp_path, request, backend):
    gateway, port, _ = gateway_at_zero(spawn, tmp_path, request, backend, maxQueueSize=1)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await write_and_close(gateway.url, PAYLOAD)
        # The only place frees once the gateway sees the close (how soon depends on the machine's
        # load): until then a request is refused as queue full; after, it is held. A place the
        # close never freed would refuse every try until the deadline.
        deadline = time.monotonic() + 10
        while True:
            answer = asyncio.create_task(
                session.post(f"{gateway.url}/v1/completions", json=PAYLOAD)
            )
            held = await held_or_refused(gateway.url, answer)
            if held:
                break
            assert time.monotonic() < deadline, "the place of the client that left never freed"
            await asyncio.sleep(0.1)
        assert not answer.done()
        await asyncio.to_thread(start_double, spawn, port)
        response = await asyncio.wait_for(answer, 15)
        async with response:
            assert response.status == 200, await response.text()


async def test_with_holding_off_a_pool_at_zero_is_refused_at_once(spawn, tmp_path, request):
    gateway, _, _ = gateway_at_zero(spawn, tmp_path, request, "memory", "--no-hold-at-zero")
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = time.monotonic()
        async with session.post(f"{gateway.url}/v1/completions", json=PAYLOAD) as response:
            body = await response.json()
        refused_s = time.monotonic() - started
    assert (response.status, body["error"]["code"]) == (503, "no_ready_endpoint")
    assert response.headers["Retry-After"] == "1"
    assert refused_s < 1.0


def test_the_measured_cold_start_comes_from_the_pools_status():
    obj = {
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"model": {"name": "chat"}},
        "status": {"coldStartSeconds": 42.5},
    }
    assert pool_from_inference_pool(obj).cold_start_s == 42.5
    for bad in (None, -1, 0, "12", True, 1e9):
        obj["status"] = {"coldStartSeconds": bad}
        assert pool_from_inference_pool(obj).cold_start_s is None  # the gateway's default


def test_cold_start_clock_counts_from_the_first_held_request():
    now = [100.0]
    starts = ColdStarts(default_s=30, clock=lambda: now[0])
    measured = Pool(MODEL, (), cold_start_s=20)
    assert starts.remaining_s(measured) == 20 and starts.estimate_s(Pool("x", ())) == 30
    starts.hold(measured)
    now[0] += 5
    starts.hold(measured)  # a second request joins the same cold start
    assert starts.remaining_s(measured) == 15
    now[0] += 30
    assert starts.remaining_s(measured) == 1  # late: try again soon
    starts.hold(measured)  # nothing held for longer than a cold start: a new one
    assert starts.remaining_s(measured) == 20
    starts.served(measured)
    now[0] += 10
    assert starts.remaining_s(measured) == 20
    full = QueueFullError("full", queue_depth=1, num_dispatched_total=0, retry_after_s=3)
    assert starts.explain(measured, full, waited_s=1, still_at_zero=True) is full
    timeout = QueueTimeoutError("timed out", retry_after_s=9)
    assert starts.explain(measured, timeout, waited_s=1, still_at_zero=False) is timeout
    explained = starts.explain(measured, timeout, waited_s=1, still_at_zero=True)
    assert (explained.status, explained.code) == (503, "cold_start_timeout")


@pytest.mark.slow
async def test_first_token_of_a_request_held_while_the_real_engine_starts(
    spawn, tmp_path, tiny_model_dir
):
    """The real engine (tiny model), started after the request: first request -> first token."""
    port = free_port()
    endpoints = [f"http://127.0.0.1:{port}"]
    # A loaded CI machine may take a minute to start an engine: the request waits for it.
    pools = write_pools(tmp_path / "pools.yaml", [pool("tiny", endpoints, queueTimeoutSeconds=180)])
    gateway = spawn.gateway(pools)
    payload = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    argv = [
        str(SLOTSERVE), "engine", "--model", str(tiny_model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
        "--max-batch-size", "2", "--max-model-len", "256",
    ]  # fmt: skip
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session:
        started = time.monotonic()
        answer = asyncio.create_task(session.post(f"{gateway.url}/v1/completions", json=payload))
        await wait_for(lambda: asyncio.to_thread(queue_size, gateway.url, "tiny"), 10, "held")
        engine_started = time.monotonic()
        engine = spawn._start(Proc, "engine", argv, port)
        ready = asyncio.create_task(asyncio.to_thread(ready_at, engine.url))
        response = await asyncio.wait_for(answer, 200)
        async with response:
            assert response.status == 200, await response.text()
            first = await response.content.readline()
            first_token_s = time.monotonic() - started
            rest = await response.read()
        engine_ready_s = await ready - started
    assert first.startswith(b"data: ") and b"[DONE]" in rest
    print(
        f"first request at zero -> first token {first_token_s:.2f} s (engine process started "
        f"{engine_started - started:.2f} s after the request, /ready at {engine_ready_s:.2f} s)"
    )
