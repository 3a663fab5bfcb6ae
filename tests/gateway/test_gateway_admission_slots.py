"""A request takes one engine slot per choice (``n``): its lease weighs ``n`` slots.

Both backends (in-process and a real redis-server): dispatch grants a lease of ``n`` only on an
endpoint with ``n`` free slots, release/expiry/restore give back ``n``, and a big request at the
head of its level waits for its slots while those behind it wait for it (FIFO: it never
starves). Through the HTTP gateway: a mix of n=1/3/4 on 4-slot engine doubles never runs more
sequences than slots at any engine, and n beyond every engine's slots is a 400 naming ``n``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import aiohttp
import pytest

from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import PoolPolicy
from tests.gateway.admission_cluster import LEASE_TTL_S
from tests.gateway.gateway_support import pool


async def _inflight_soon(replica: Admission, pool: PoolPolicy, expected: dict[str, int]) -> None:
    """The backend's slot count reaches ``expected`` (a release is done in a background task)."""
    deadline = time.monotonic() + 3
    while (got := await replica.backend.inflight(pool)) != expected:
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.02)


async def test_a_lease_holds_n_slots_and_a_release_frees_them(cluster):
    pool = cluster.serve(PoolPolicy("m", queue_timeout_s=10), ("http://a", 4, 0.0))
    replica = await cluster.replica()
    big = await replica.acquire(pool, priority=5, timeout_s=5, slots=4)
    assert big.slots == 4
    assert await replica.backend.inflight(pool) == {"http://a": 4}
    small = asyncio.create_task(replica.acquire(pool, priority=5, timeout_s=5))
    await asyncio.sleep(0.3)
    assert not small.done()  # 4 of 4 slots held by one request
    await replica.release(big)
    lease = await asyncio.wait_for(small, 5)
    await _inflight_soon(replica, pool, {"http://a": 1})  # the 4 came back, 1 taken again
    three = await replica.acquire(pool, priority=5, timeout_s=5, slots=3)  # 1 + 3 fit in 4
    assert await replica.backend.inflight(pool) == {"http://a": 4}
    await replica.release(lease)
    await replica.release(three)
    await _inflight_soon(replica, pool, {})


async def test_mixed_n_never_exceeds_slots_across_replicas(cluster):
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=500, queue_timeout_s=20),
        ("http://a", 4, 0.0),
        ("http://b", 4, 0.0),
    )
    replicas = [await cluster.replica() for _ in range(3)]
    current: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    sizes = [random.Random(i).choice([1, 1, 3, 4]) for i in range(120)]

    async def one(i: int) -> int:
        replica = replicas[i % 3]
        lease = await replica.acquire(pool, priority=5, timeout_s=20, slots=sizes[i])
        current[lease.endpoint] += lease.slots
        peak[lease.endpoint] = max(peak[lease.endpoint], current[lease.endpoint])
        await asyncio.sleep(0.002 * (i % 5))
        current[lease.endpoint] -= lease.slots
        await replica.release(lease)
        return lease.slots

    granted = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(120))), 30)
    assert granted == sizes
    assert max(peak.values()) == 4  # full, and never more
    await _inflight_soon(replicas[0], pool, {})


async def test_a_big_head_waits_for_its_slots_and_smaller_ones_wait_behind_it(cluster):
    """FIFO within a level, as Triton/vLLM queue: an n=4 request at the head is not passed by
    n=1 requests that would fit now, so it cannot starve; it goes as soon as 4 slots are free."""
    pool = cluster.serve(PoolPolicy("m", queue_timeout_s=10), ("http://a", 4, 0.0))
    first, second = await cluster.replica(), await cluster.replica()
    holder = await first.acquire(pool, priority=5, timeout_s=5, slots=2)
    order: list[str] = []

    async def waiter(name: str, replica: Admission, slots: int) -> None:
        lease = await replica.acquire(pool, priority=5, timeout_s=10, slots=slots)
        order.append(name)
        await asyncio.sleep(0.1)
        await replica.release(lease)

    big = asyncio.create_task(waiter("big", second, 4))
    await asyncio.sleep(0.05)
    smalls = [asyncio.create_task(waiter(f"small{i}", first, 1)) for i in range(2)]
    await asyncio.sleep(0.4)
    assert order == []  # 2 slots free, but the head needs 4 and the small ones are behind it
    await first.release(holder)
    await asyncio.wait_for(asyncio.gather(big, *smalls), 10)
    assert order == ["big", "small0", "small1"]


async def test_expiry_and_restore_give_back_and_take_back_n_slots(cluster):
    pool = cluster.serve(PoolPolicy("m", queue_timeout_s=10), ("http://a", 4, 0.0))
    replica = await cluster.replica()
    lease = await replica.acquire(pool, priority=5, timeout_s=5, slots=3)
    # The backend loses its state (Redis FLUSHALL): the replica writes its lease back, weighing 3.
    if cluster.kind == "memory":
        cluster.hub.pools.clear()
    else:
        await replica.backend.client.flushall()
    assert await replica.backend.inflight(pool) == {}
    await replica.backend.heartbeat(replica.ledger.held_by_pool(), restore=True)
    assert await replica.backend.inflight(pool) == {"http://a": 3}
    await replica.release(lease)
    await _inflight_soon(replica, pool, {})

    # A dead replica's n=4 lease expires after one lease TTL and frees all 4 slots.
    dead, alive = await cluster.replica(), await cluster.replica()
    await dead.acquire(pool, priority=5, timeout_s=5, slots=4)
    dead.spawn = lambda coro: coro.close()  # no release, no heartbeat from now on
    for task in dead._tasks:
        task.cancel()
    started = time.monotonic()
    lease = await alive.acquire(pool, priority=5, timeout_s=LEASE_TTL_S * 4, slots=4)
    assert LEASE_TTL_S * 0.5 < time.monotonic() - started < LEASE_TTL_S * 3
    await alive.release(lease)
    await _inflight_soon(alive, pool, {})


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_gateway_counts_n_slots_per_request(gw, spawn, client, request, backend):
    engines = [spawn.double(slots=4, delay=0.05) for _ in range(2)]
    overrides = {}
    if backend == "redis":
        overrides["redis_url"] = request.getfixturevalue("redis_server").url
    url = await gw([pool("m", [e.url for e in engines], maxQueueSize=500)], **overrides)
    sizes = [random.Random(i).choice([1, 3, 4]) for i in range(60)]

    async def post(i: int) -> int:
        body = {"model": "m", "prompt": f"r{i}", "max_tokens": 4, "n": sizes[i]}
        async with client.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    statuses = await asyncio.gather(*(post(i) for i in range(60)))
    assert Counter(statuses) == {200: 60}
    stats = [e.stats() for e in engines]
    # The engines' own count of sequences in flight: full, and never more than their slots.
    assert max(st["max_inflight"] for st in stats) == 4
    assert all(st["max_inflight"] <= 4 for st in stats)
    assert sum(st["num_requests"] for st in stats) == 60

    # n beyond every engine's slots: 400 naming n at once, and no engine ever sees it.
    body = {"model": "m", "prompt": "too many", "max_tokens": 4, "n": 5}
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == "n" and "slots" in error["message"]
    assert sum(e.stats()["num_requests"] for e in engines) == 60


async def test_gateway_metrics_count_slots_in_flight(gw, spawn):
    engine = spawn.double(slots=4, delay=1.0)
    url = await gw([pool("m", [engine.url])])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        body = {"model": "m", "prompt": "x", "max_tokens": 4, "n": 3}
        answer = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
        await asyncio.sleep(0.5)
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        line = next(x for x in text.splitlines() if x.startswith("slotserve_gateway_inflight_"))
        assert line.endswith(" 3.0"), line
        (await answer).release()
