"""Triton-style queue policy per priority level, on both backends (in-process and real Redis).

Per-level ``maxQueueSize`` (a flood at one level leaves the others their places), per-level
``queueTimeoutSeconds`` with ``REJECT`` (503) or ``DELAY`` (demoted behind every request that
has not timed out, given up after twice the timeout), and the pool's own aging step.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.types import (
    LevelPolicy,
    PoolPolicy,
    QueueFullError,
    QueueTimeoutError,
)
from tests.gateway.admission_cluster import Cluster


def _pool(**levels: LevelPolicy) -> PoolPolicy:
    policy = tuple((int(name[1:]), level) for name, level in levels.items())
    return PoolPolicy("m", max_queue_size=20, queue_timeout_s=30, priority_queue_policy=policy)


async def _acquire(replica: Admission, pool: PoolPolicy, priority: int) -> Lease:
    wait = pool.queue_wait(priority)
    return await replica.acquire(
        pool, priority, wait.give_up_after_s, demote_after_s=wait.demote_after_s
    )


async def test_a_flood_at_one_level_leaves_other_levels_their_places(cluster: Cluster):
    pool = cluster.serve(_pool(l5=LevelPolicy(4, 30)), ("http://a", 1, 0.0))
    a, b = await cluster.replica(), await cluster.replica()
    busy = await a.acquire(pool, 5, 5)
    flood = [asyncio.create_task(_acquire(r, pool, 5)) for r in (a, b) * 5]
    await asyncio.sleep(0.3)
    rejected = [t for t in flood if t.done() and isinstance(t.exception(), QueueFullError)]
    assert len(rejected) == 6, "level 5 holds at most its own 4"
    assert "level 5" in str(rejected[0].exception())
    assert all(1 <= t.exception().retry_after_s <= 30 for t in rejected)  # type: ignore[union-attr]
    # Every other level still queues (the pool holds 20), and level 3 goes first.
    others = [asyncio.create_task(_acquire(b, pool, level)) for level in (3, 7, 7)]
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in others)
    await a.release(busy)
    first = await asyncio.wait_for(others[0], 5)
    assert not any(t.done() for t in flood if t not in rejected)
    await b.release(first)
    for task in [t for t in flood if t not in rejected] + others[1:]:
        await (a if task in flood else b).release(await asyncio.wait_for(task, 5))


async def test_reject_level_times_out_at_its_own_timeout(cluster: Cluster):
    pool = cluster.serve(_pool(l2=LevelPolicy(20, 0.3, "REJECT")), ("http://a", 1, 0.0))
    a = await cluster.replica()
    busy = await a.acquire(pool, 5, 5)
    started = time.monotonic()
    with pytest.raises(QueueTimeoutError) as info:
        await asyncio.wait_for(_acquire(a, pool, 2), 5)
    assert 0.25 < time.monotonic() - started < 1.5
    assert info.value.retry_after_s >= 1
    await a.release(busy)


async def test_delay_level_is_demoted_behind_requests_that_have_not_timed_out(cluster: Cluster):
    pool = cluster.serve(_pool(l2=LevelPolicy(20, 0.3, "DELAY")), ("http://a", 1, 0.0))
    a, b = await cluster.replica(), await cluster.replica()
    busy = await a.acquire(pool, 5, 5)
    delayed = asyncio.create_task(_acquire(a, pool, 2))
    await asyncio.sleep(0.45)  # past its 0.3 s: demoted, but still waiting (no 503)
    assert not delayed.done()
    # Same level, later: without demotion it would come after the first one.
    fresh = asyncio.create_task(_acquire(b, pool, 2))
    await asyncio.sleep(0.05)
    await a.release(busy)
    lease = await asyncio.wait_for(fresh, 2)
    await asyncio.sleep(0.05)
    assert not delayed.done(), "the demoted request waits behind the one that has not timed out"
    await b.release(lease)
    await a.release(await asyncio.wait_for(delayed, 2))  # then it is served


async def test_delay_level_gives_up_after_twice_its_timeout(cluster: Cluster):
    pool = cluster.serve(_pool(l2=LevelPolicy(20, 0.3, "DELAY")), ("http://a", 1, 0.0))
    a = await cluster.replica()
    busy = await a.acquire(pool, 5, 5)
    started = time.monotonic()
    with pytest.raises(QueueTimeoutError):
        await asyncio.wait_for(_acquire(a, pool, 2), 5)
    assert 0.55 < time.monotonic() - started < 2.0
    await a.release(busy)


async def test_the_pools_aging_step_overrides_the_gateways(cluster: Cluster):
    """Aging 0 s: arrival order alone, whatever the level; the gateway's 2 s would put a later
    level-1 request first."""
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=20, queue_timeout_s=30, priority_aging_s=0.0),
        ("http://a", 1, 0.0),
    )
    a = await cluster.replica()
    busy = await a.acquire(pool, 5, 5)
    low = asyncio.create_task(a.acquire(pool, 9, 5))
    await asyncio.sleep(0.05)
    high = asyncio.create_task(a.acquire(pool, 1, 5))
    await asyncio.sleep(0.05)
    await a.release(busy)
    first = await asyncio.wait_for(low, 2)
    await asyncio.sleep(0.05)
    assert not high.done(), "aging 0: the level-9 request came first and goes first"
    await a.release(first)
    await a.release(await asyncio.wait_for(high, 2))
