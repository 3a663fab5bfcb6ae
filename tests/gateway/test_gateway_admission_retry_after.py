"""Retry-After is honest: a client that comes back when told gets in, during a steady overload.

60 clients in a closed loop against 4 slots that serve a request in 0.2 s (20 requests/s) and a
queue of 10: each client sends its next request as soon as it has an answer, and after a 429
waits exactly the Retry-After it was given. About 46 clients are always backing off, so every
place that frees is wanted at once; without places promised to rejected clients, the clients
that just finished would take them all and the retries would nearly always fail.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from slotserve.gateway.admission.drain import (
    DrainRate,
    HoldTime,
    promise_gap_us,
    service_rate_per_s,
)
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import PoolPolicy, QueueFullError, QueueTimeoutError
from tests.gateway.admission_cluster import Cluster

NUM_CLIENTS = 60
SERVICE_S = 0.2
RUN_S = 14.0
WARMUP_S = 3.0  # the drain is measured from the first seconds


async def _overload(cluster: Cluster) -> tuple[int, int, int, list[int]]:
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=10, queue_timeout_s=30), ("http://a", 4, 0.0)
    )
    replicas = [await cluster.replica() for _ in range(2)]
    started = time.monotonic()
    retries = admitted_retries = served = 0
    retry_afters: list[int] = []
    rng = random.Random(6)

    async def client(replica: Admission) -> None:
        nonlocal retries, admitted_retries, served
        retrying = False
        await asyncio.sleep(rng.random())  # the overload builds up within a second
        while time.monotonic() - started < RUN_S:
            counted = retrying and time.monotonic() - started > WARMUP_S
            try:
                lease = await replica.acquire(pool, priority=5, timeout_s=30)
            except QueueFullError as exc:
                retries += counted
                retry_afters.append(exc.retry_after_s)
                retrying = True
                await asyncio.sleep(exc.retry_after_s)
                continue
            retries += counted
            admitted_retries += counted
            served += time.monotonic() - started > WARMUP_S
            retrying = False
            await asyncio.sleep(SERVICE_S)
            await replica.release(lease)

    await asyncio.wait_for(
        asyncio.gather(*(client(replicas[i % 2]) for i in range(NUM_CLIENTS))), RUN_S + 40
    )
    return retries, admitted_retries, served, retry_afters


@pytest.mark.serial  # timing-sensitive: no parallel suite beside it
@pytest.mark.wall_clock  # asleep on Retry-After windows: one other serial test may run
async def test_a_client_back_after_its_retry_after_is_admitted(cluster):
    retries, admitted, served, retry_afters = await _overload(cluster)
    share = admitted / retries
    use = served * SERVICE_S / 4 / (RUN_S - WARMUP_S)  # of the 4 slots' time
    print(
        f"{cluster.kind}: {admitted}/{retries} retries admitted ({share:.0%}); "
        f"Retry-After {min(retry_afters)}..{max(retry_afters)} s; slots used {use:.0%}"
    )
    assert use > 0.6  # holding places for returning clients costs some throughput, not most
    assert retries > 100
    assert share >= 0.8, (admitted, retries)
    # Derived from the drain (46 clients backing off at 20/s: ~2-3 s), never a 60 s cap.
    assert max(retry_afters) <= 10


def test_the_drain_is_the_engines_speed_then_the_dispatch_rate():
    drain, hold = DrainRate(), HoldTime()
    assert service_rate_per_s(drain, hold, 8) == 0  # nothing known: one place a second
    assert promise_gap_us(0) == 1_000_000
    drain.observe(0.0, 100)
    drain.observe(1.0, 130)  # dispatched 30/s before any request finished
    assert service_rate_per_s(drain, hold, 8) == 30
    hold.observe(0.5)  # engines answered in 0.5 s: 8 full slots drain 16 requests/s
    assert service_rate_per_s(drain, hold, 8) == 16


@pytest.mark.serial  # timing-sensitive: no parallel suite beside it
@pytest.mark.wall_clock  # asleep on Retry-After windows: one other serial test may run
async def test_places_promised_to_clients_that_never_come_back_expire(cluster):
    """A burst is told to come back (429 + Retry-After, one place a second up to 20 s ahead) and
    never does. Once the queue drained, newcomers that must wait still get a place at once
    (before: the whole queue was held, 429 with Retry-After up to 20 s while it was empty): only
    promises due within 5 s hold a place, and never more than 3/4 of the queue."""
    pool = cluster.serve(
        PoolPolicy("m", max_queue_size=4, queue_timeout_s=30), ("http://a", 1, 0.0)
    )
    replica = await cluster.replica()
    holder = await replica.acquire(pool, priority=5, timeout_s=5)
    waiting = [
        asyncio.create_task(replica.acquire(pool, priority=5, timeout_s=20)) for _ in range(4)
    ]
    await asyncio.sleep(0.2)
    told = []
    for _ in range(20):
        try:
            await replica.acquire(pool, priority=5, timeout_s=5)
        except QueueFullError as exc:
            told.append(exc.retry_after_s)
    assert len(told) == 20 and max(told) >= 10
    await replica.release(holder)
    for task in waiting:  # the queue drains; none of the 20 comes back
        await replica.release(await asyncio.wait_for(task, 5))
    busy = await replica.acquire(pool, priority=5, timeout_s=5)  # newcomers must wait now

    async def newcomer() -> str:
        try:
            lease = await replica.acquire(pool, priority=5, timeout_s=0.5)
        except QueueFullError:
            return "429"
        except QueueTimeoutError:
            return "queued"
        await replica.release(lease)
        return "granted"

    outcomes = await asyncio.gather(*(newcomer() for _ in range(4)))
    assert outcomes.count("queued") >= 1, outcomes  # at most 3 of the 4 places are held
    await replica.release(busy)
