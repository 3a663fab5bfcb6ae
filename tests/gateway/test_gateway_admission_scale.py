"""Bounded work per step: with 20,000 requests waiting, no Redis command is slow.

Half of the waiting requests belong to a replica that dies and a quarter time out together, so
the sweep has ~15,000 entries to drop while three replicas tick. A separate client PINGs Redis
all along; Redis's own SLOWLOG records every command over 20 ms. A shared machine can pause Redis
in the middle of any command (CI saw one to three commands at 26-33 ms in a run that took under
3 ms each otherwise), so a run with slow commands is run again: unbounded work is slow every time
(a sweep of 5,000 entries a script: 49 ms, in both runs), a pause of the machine seldom twice.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from slotserve.gateway.admission.backends.redis import RedisBackend
from slotserve.gateway.admission.types import AdmissionBackend, PoolPolicy
from slotserve.gateway.pools.routing import EndpointOffer
from tests.gateway.admission_cluster import Cluster
from tests.support import RedisServer

SLOW_US = 20_000
NUM_WAITING = 20_000
# PINGs until its stdin closes, or for the given seconds at most.
PINGER = """
import select, sys, time, redis
client = redis.Redis(port=int(sys.argv[1]))
stop_at = time.monotonic() + float(sys.argv[2])
while time.monotonic() < stop_at and not select.select([sys.stdin], [], [], 0)[0]:
    sent = time.perf_counter()
    client.ping()
    print((time.perf_counter() - sent) * 1000)
    time.sleep(0.01)
"""


async def _fill(backend: AdmissionBackend, pool: PoolPolicy, num: int, timeout_s: float) -> None:
    offers = [EndpointOffer("http://a", 1, 0.0)]
    for start in range(0, num, 2000):
        await asyncio.gather(
            *(
                backend.enqueue(pool, offers, uuid.uuid4().hex, 5, int(timeout_s * 1e6))
                for _ in range(min(2000, num - start))
            )
        )


@dataclass
class SweepRun:
    swept_after_s: float | None
    pings_ms: list[float]  # sorted
    slow: list[tuple[int, bytes]]  # (us, command), slowest last


async def _sweep_under_load(redis_server: RedisServer) -> SweepRun:
    """20,000 waiting in a pool of its own (a fresh key prefix); the sweep timed, PINGed and
    SLOWLOGged until a second after it ends."""
    probe = aioredis.Redis.from_url(redis_server.url)
    await probe.config_set("slowlog-log-slower-than", SLOW_US)
    # Filling 20,000 entries from this one event loop delays the replicas' heartbeats: a long
    # lease TTL keeps them alive through it (in production each replica has its own process).
    cl = Cluster("redis", redis_server.url, lease_ttl_s=20)
    pool = cl.serve(
        PoolPolicy("m", max_queue_size=NUM_WAITING * 2, queue_timeout_s=600),
        ("http://a", 1, 0.0),
    )
    try:
        # The epoch a fresh Redis starts holds dispatching back for half the first caller's
        # lease TTL (10 s here): a replica with a short TTL starts it, so no one sleeps through
        # that grace (the first run's; a second run's prefix is new, its epoch too).
        starter = RedisBackend(redis_server.url, "starter", prefix=cl.prefix, lease_ttl_s=0.2)
        await starter.heartbeat({}, restore=False)
        await starter.close()
        replicas = [await cl.replica() for _ in range(3)]
        # One replica's worth of entries that will die with it, a quarter that time out at
        # once, and the rest live; the single slot stays busy so that nothing dispatches.
        holder = await replicas[0].acquire(pool, priority=5, timeout_s=5)
        # (Alive until its key is deleted below: its heartbeat would last 600 s.)
        doomed = RedisBackend(redis_server.url, "doomed", prefix=cl.prefix, lease_ttl_s=600)
        await doomed.heartbeat({}, restore=False)
        await _fill(doomed, pool, NUM_WAITING // 2, 600)
        await _fill(replicas[2].backend, pool, NUM_WAITING // 4, 600)
        await _fill(replicas[1].backend, pool, NUM_WAITING // 4, 5.0)  # time out together
        assert await probe.zcard(cl.prefix + ":{m}:queue") == NUM_WAITING
        await probe.slowlog_reset()
        await probe.delete(doomed.keys.replica("doomed"))  # it dies now
        # PING from another process, so that this event loop's own work is not counted.
        pinger = subprocess.Popen(
            [sys.executable, "-c", PINGER, str(redis_server.port), "10"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        swept_after = None
        started = time.monotonic()
        while pinger.poll() is None and (
            swept_after is None or time.monotonic() - started < swept_after + 1
        ):
            if swept_after is None and await probe.zcard(cl.prefix + ":{m}:queue") <= (
                NUM_WAITING // 4
            ):
                swept_after = time.monotonic() - started
            await asyncio.sleep(0.05)
        pings = sorted(float(ms) for ms in pinger.communicate(b"stop\n", timeout=10)[0].split())
        slow = await probe.slowlog_get(128)
        await replicas[0].release(holder)
        await doomed.close()
    finally:
        await cl.close()
        await probe.aclose()
    slowest = sorted((entry["duration"], entry["command"][:60]) for entry in slow)
    return SweepRun(swept_after, pings, slowest)


@pytest.mark.serial  # timing-sensitive: measured alone
async def test_20k_waiting_keeps_every_command_and_ping_under_20ms(redis_server):
    run = await _sweep_under_load(redis_server)
    if run.slow:
        print(f"SLOWLOG (first run): {len(run.slow)} over {SLOW_US} us, {run.slow[-3:]}; again")
        run = await _sweep_under_load(redis_server)
    # The dead replica's 10,000 and the 5,000 expired entries are gone, a batch per tick.
    assert run.swept_after_s is not None and run.swept_after_s < 8, run.swept_after_s
    print(f"SLOWLOG: {len(run.slow)} commands over {SLOW_US} us, slowest {run.slow[-1:]}")
    assert not run.slow, run.slow
    pings = run.pings_ms
    median, p99, slowest_ping = pings[len(pings) // 2], pings[len(pings) * 99 // 100], pings[-1]
    print(
        f"PING ms: median {median:.2f}, p99 {p99:.2f}, max {slowest_ping:.2f}; "
        f"swept in {run.swept_after_s:.1f} s"
    )
    # SLOWLOG above is Redis's own account. A PING measured from a client process also waits
    # for that process to be scheduled, which on a shared 2-core machine can alone take tens of
    # ms now and then; so the bound is on the 99th percentile (the max is printed).
    assert p99 < SLOW_US / 1000, pings[-10:]
