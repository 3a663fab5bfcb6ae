"""Admission under disconnects at every moment and under Redis losing its data.

Both backends where the fault exists in both (disconnects); Redis only where it is Redis's
(FLUSHALL, restart without persistence). Real redis-server processes throughout.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis.asyncio as aioredis

from slotserve.gateway.admission.types import AdmissionError, PoolPolicy
from tests.gateway.admission_cluster import LEASE_TTL_S, Cluster


async def test_a_disconnect_at_any_moment_leaks_no_slot(cluster):
    """Callers cancelled at random moments (enqueue in flight, queued, just granted, holding)."""
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=100, queue_timeout_s=10), ("http://a", 1, 0.0)
    )
    replicas = [await cluster.replica() for _ in range(2)]
    rng = random.Random(13)

    async def client(i: int) -> None:
        replica = replicas[i % 2]
        lease = await replica.acquire(pool, priority=5, timeout_s=10)
        try:
            await asyncio.sleep(rng.random() * 0.004)
        finally:
            replica.release_soon(lease)

    tasks = []
    for i in range(300):
        task = asyncio.create_task(client(i))
        tasks.append(task)
        # Cancel after 0..3 loop turns or a little time: every moment of a request's life.
        pause = rng.choice([0, 0, 0.0005, 0.002])
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        await asyncio.sleep(pause)
        if rng.random() < 0.6:
            task.cancel()
    await asyncio.wait(tasks, timeout=20)
    assert all(task.done() for task in tasks)
    started = time.monotonic()
    # Every slot is back at once, not after a lease TTL.
    lease = await replicas[0].acquire(pool, priority=5, timeout_s=LEASE_TTL_S / 2)
    assert time.monotonic() - started < LEASE_TTL_S / 2
    await replicas[0].release(lease)
    await asyncio.sleep(0.1)
    assert await replicas[0].backend.inflight(pool) == {}
    assert all(not r.ledger.leases and not r.ledger.waiters for r in replicas)


async def test_a_grant_in_the_reply_of_a_cancelled_enqueue_is_released(cluster):
    """The case of the report: the client leaves while the enqueue step is in flight."""
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=10, queue_timeout_s=10), ("http://a", 1, 0.0)
    )
    a = await cluster.replica()
    for _ in range(5):
        task = asyncio.create_task(a.acquire(pool, priority=5, timeout_s=10))
        await asyncio.sleep(0)  # the enqueue step is on its way (or done, in-process)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():  # it was granted before the cancel: the caller releases
            await a.release(task.result())
    started = time.monotonic()
    lease = await a.acquire(pool, priority=5, timeout_s=5)
    assert time.monotonic() - started < 0.3  # not a lease TTL
    await a.release(lease)


@pytest.mark.parametrize("loss", ["flushall", "restart"])
async def test_redis_losing_its_data_never_over_admits(redis_server, loss):
    cl = Cluster("redis", redis_server.url)
    try:
        pool = cl.serve(
            PoolPolicy("m", max_queue_size=10, queue_timeout_s=20), ("http://a", 1, 0.0)
        )
        holder, other = await cl.replica(), await cl.replica()
        lease = await holder.acquire(pool, priority=5, timeout_s=5)
        if loss == "flushall":
            client = aioredis.Redis.from_url(redis_server.url)
            await client.flushall()
            await client.aclose()
        else:  # no persistence: the server comes back empty
            redis_server.stop()
            redis_server.start()
        lost_at = time.monotonic()
        waiter = asyncio.create_task(other.acquire(pool, priority=5, timeout_s=20))
        # The only slot is still in use: for two lease TTLs nobody may get it, whatever the
        # timing of heartbeats (the waiter may see 503 while Redis restarts: then ask again).
        while time.monotonic() - lost_at < 2 * LEASE_TTL_S:
            await asyncio.sleep(0.05)
            if waiter.done():
                assert isinstance(waiter.exception(), AdmissionError), waiter
                waiter = asyncio.create_task(other.acquire(pool, priority=5, timeout_s=20))
        assert not waiter.done()
        assert await holder.backend.inflight(pool) == {"http://a": 1}
        await holder.release(lease)
        second = await asyncio.wait_for(waiter, 5)
        await other.release(second)
    finally:
        await cl.close()
