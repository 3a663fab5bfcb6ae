"""Deadline-aware refusal (issue 26, item 3), on both backends.

A 1-slot pool whose engine holds each request 0.2 s (measured by the gateway from the first
requests). With the slot busy and five requests queued, a request that may wait 0.5 s is
predicted to wait ~1.2 s: with ``deadline_refusal`` it is refused at once (429 ``deadline``,
Retry-After) and takes no place; without, it waits its 0.5 s in the queue and times out. One that
may wait 5 s is queued, and so is a short one at a better priority (nothing ahead of it).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from slotserve.gateway.admission.drain import wait_gap_us
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import (
    DeadlineUnreachableError,
    PoolPolicy,
    QueueTimeoutError,
)
from tests.gateway.admission_cluster import Cluster
from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_http import completion

SERVICE_S = 0.2


async def _busy_pool(cluster: Cluster, refuse: bool) -> tuple[PoolPolicy, Admission, list]:
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=10, queue_timeout_s=30), ("http://a", 1, 0.0)
    )
    replica = await cluster.replica()
    replica.deadline_refusal = refuse
    for _ in range(3):  # the drain is measured: 0.2 s a request on the one slot
        lease = await replica.acquire(pool, priority=5, timeout_s=5)
        await asyncio.sleep(SERVICE_S)
        await replica.release(lease)
    assert 150_000 < wait_gap_us(replica.service_rate("m")) < 400_000
    holder = await replica.acquire(pool, priority=5, timeout_s=5)
    queued = [
        asyncio.create_task(replica.acquire(pool, priority=5, timeout_s=30)) for _ in range(5)
    ]
    await asyncio.sleep(0.1)
    return pool, replica, [holder, *queued]


async def _drain(replica: Admission, held: list) -> None:
    await replica.release(held[0])
    for task in held[1:]:
        await replica.release(await asyncio.wait_for(task, 10))


async def test_a_request_that_cannot_make_its_deadline_is_refused_at_once(cluster):
    pool, replica, held = await _busy_pool(cluster, refuse=True)
    started = time.monotonic()
    with pytest.raises(DeadlineUnreachableError) as refused:
        await replica.acquire(pool, priority=5, timeout_s=0.5)
    assert time.monotonic() - started < 0.3  # at once, not after its 0.5 s
    assert refused.value.status == 429 and refused.value.code == "deadline"
    assert refused.value.retry_after_s >= 1
    assert replica.queue_depth("m") == 5  # it took no place
    # Time enough (5 s for ~1.2 s predicted): queued as ever.
    patient = asyncio.create_task(replica.acquire(pool, priority=5, timeout_s=5))
    # A better level has nothing ahead of it (aging: level 1 is 8 s ahead of level 5).
    urgent = asyncio.create_task(replica.acquire(pool, priority=1, timeout_s=0.5))
    await asyncio.sleep(0.05)
    assert not patient.done() and not urgent.done()
    await replica.release(held.pop(0))
    await replica.release(await asyncio.wait_for(urgent, 1))  # the slot, first
    await replica.release(await asyncio.wait_for(held.pop(0), 10))
    held.append(patient)
    for task in held:
        await replica.release(await asyncio.wait_for(task, 10))


async def test_without_deadline_refusal_the_same_request_times_out_in_the_queue(cluster):
    pool, replica, held = await _busy_pool(cluster, refuse=False)
    started = time.monotonic()
    with pytest.raises(QueueTimeoutError):
        await replica.acquire(pool, priority=5, timeout_s=0.5)
    assert time.monotonic() - started >= 0.5  # it held a place for its whole wait
    await _drain(replica, held)


async def _post(client, url: str, delay: float, **headers: str) -> tuple[int, dict, dict]:
    body = completion(prompt="x", x_delay=delay)
    async with client.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_through_a_gateway_the_refusal_is_a_429_with_retry_after_and_counted(
    backend, spawn, client, tmp_path, request
):
    redis_url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    engine = spawn.double(slots=1, delay=0.01)
    pools = write_pools(tmp_path / "pools.yaml", [pool("m", [engine.url])])
    gateway = spawn.gateway(pools, redis_url, extra=["--deadline-refusal"])
    for _ in range(3):  # the gateway measures the engine: ~0.2 s a request
        assert (await _post(client, gateway.url, 0.2))[0] == 200
    busy = [asyncio.create_task(_post(client, gateway.url, 0.2)) for _ in range(6)]
    await asyncio.sleep(0.15)  # one on the slot, five queued: ~1.2 s to wait
    status, body, headers = await _post(
        client, gateway.url, 0.01, **{"x-slotserve-deadline-ms": "400"}
    )
    assert (status, body["error"]["code"]) == (429, "deadline"), body
    assert int(headers["Retry-After"]) >= 1
    patient = await _post(client, gateway.url, 0.01, **{"x-slotserve-deadline-ms": "20000"})
    assert patient[0] == 200  # time enough: queued and served
    assert [(await task)[0] for task in busy] == [200] * 6
    async with client.get(f"{gateway.url}/metrics") as resp:
        metrics = await resp.text()
    assert 'slotserve_gateway_rejected_total{pool="m",reason="deadline"} 1.0' in metrics
