"""No request can poison a pool's admission (issue 25, point 2).

- ``n`` is bounded always: by the engine's limit (128) and the slots of the pool's biggest ready
  engine, or at zero (no engine ready) by the pool's ``maxBatchSize``: ``n = 10**14`` held at zero
  used to be written as ``1e+14`` and fail every later script of the pool.
- A head that no ready engine can hold is refused (400 naming ``n``), never blocking the queue
  behind it: both backends.
- An entry that does not parse (an older gateway's, a hand edit) is dropped and counted, and the
  pool keeps admitting; a drained queue resets the counts of waiting requests.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from slotserve.gateway.admission.types import NoEngineFitsError, PoolPolicy
from slotserve.gateway.pools.routing import EndpointOffer
from tests.gateway.gateway_support import DOUBLE, Proc, pool
from tests.support import free_port, http_ok, wait_until


def _post(client, url: str, n: int):
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "n": n}
    return client.post(f"{url}/v1/completions", json=body)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_n_is_bounded_at_zero_by_the_pools_max_batch_size(gw, client, request, backend):
    overrides = {}
    if backend == "redis":
        overrides["redis_url"] = request.getfixturevalue("redis_server").url
    spec = pool("m", [f"http://127.0.0.1:{free_port()}"])  # nothing listens: the pool is at zero
    spec["batching"]["maxBatchSize"] = 8
    url = await gw([spec], **overrides)
    for n in (10**14, 129, 9):
        started = time.monotonic()
        async with _post(client, url, n) as resp:
            assert resp.status == 400, n
            error = (await resp.json())["error"]
        assert time.monotonic() - started < 1  # at once, never queued
        assert error["param"] == "n" and "(at most 8)" in error["message"], error
    if backend == "redis":
        # Nothing was written for them: no entry, no count of waiting requests.
        client_redis = request.getfixturevalue("redis_server")
        import redis

        r = redis.Redis.from_url(client_redis.url, decode_responses=True)
        assert r.hlen("slotserve:{m}:levels") == 0 and r.zcard("slotserve:{m}:queue") == 0


def _start_double(spawn, port: int, slots: int) -> Proc:
    argv = [sys.executable, str(DOUBLE), "--port", str(port), "--slots", str(slots)]
    argv += ["--delay", "0.05", "--model", "m"]
    proc = spawn._start(Proc, "double", argv, port)
    wait_until(lambda: http_ok(f"{proc.url}/health"), 15, what="engine double")
    return proc


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_head_no_engine_can_hold_is_refused_not_blocking(
    gw, spawn, client, request, backend
):
    """At zero an n=8 request fits the pool's maxBatchSize (32) and waits; the engine that comes
    has 4 slots (its memory held fewer rows): the head is refused with 400 and the n=1 requests
    behind it are served at once (before: they waited out the head's queue timeout, 15 s)."""
    overrides = {}
    if backend == "redis":
        overrides["redis_url"] = request.getfixturevalue("redis_server").url
    port = free_port()
    spec = pool("m", [f"http://127.0.0.1:{port}"], queueTimeoutSeconds=15)
    spec["batching"]["maxBatchSize"] = 32
    url = await gw([spec], **overrides)

    async def post(n: int) -> tuple[int, float, dict]:
        async with _post(client, url, n) as resp:
            return resp.status, time.monotonic(), await resp.json()

    big = asyncio.create_task(post(8))
    await asyncio.sleep(0.3)
    small = [asyncio.create_task(post(1)) for _ in range(3)]
    await asyncio.sleep(0.3)
    _start_double(spawn, port, slots=4)
    engine_up = time.monotonic()
    status, _, body = await asyncio.wait_for(big, 10)
    assert status == 400 and body["error"]["param"] == "n"
    assert "every ready engine" in body["error"]["message"]
    for status, answered, _ in await asyncio.wait_for(asyncio.gather(*small), 10):
        assert status == 200
        assert answered - engine_up < 3  # a /load poll and a tick, not the head's 15 s


async def test_a_queued_head_is_refused_when_the_engines_shrink(cluster):
    """Backend level, both backends: an n=4 request waits behind a full 4-slot engine; the
    engine is replaced by a 2-slot one: the head is refused (its waiter gets the error, nothing is
    held) and the n=1 behind it is granted."""
    policy = cluster.serve(PoolPolicy("m", queue_timeout_s=10), ("http://a", 4, 0.0))
    replica, other = await cluster.replica(), await cluster.replica()
    holder = await replica.acquire(policy, priority=5, timeout_s=5, slots=4)
    big = asyncio.create_task(other.acquire(policy, priority=5, timeout_s=10, slots=4))
    await asyncio.sleep(0.1)
    small = asyncio.create_task(replica.acquire(policy, priority=5, timeout_s=10))
    await asyncio.sleep(0.1)
    cluster.offers["m"] = [EndpointOffer("http://b", 2, 0.0)]
    started = time.monotonic()
    with pytest.raises(NoEngineFitsError):
        await asyncio.wait_for(big, 5)
    lease = await asyncio.wait_for(small, 5)
    assert lease.endpoint == "http://b" and time.monotonic() - started < 1
    assert not other.ledger.leases and not other.ledger.waiters
    await replica.release(lease)
    await replica.release(holder)


async def test_entries_that_do_not_parse_are_dropped_and_counted(redis_server):
    """Entries an older gateway wrote with Lua's %.14g (``1e+14``), or any garbage, at the head
    of the queue: dropped and counted (``bad_entries``), the pool keeps admitting, and the counts
    of waiting requests come back to zero once the queue drains."""
    import redis

    from tests.gateway.admission_cluster import Cluster

    cluster = Cluster("redis", redis_server.url)
    try:
        policy = cluster.serve(PoolPolicy("m", queue_timeout_s=10), ("http://a", 2, 0.0))
        replica = await cluster.replica()
        r = redis.Redis.from_url(redis_server.url, decode_responses=True)
        key = f"{cluster.prefix}:{{m}}"
        name = replica.backend.replica_id
        hostile = {
            "a": f"{name}|99999999999999999|1|5|1e+14",
            "b": f"{name}|99999999999999999|1|1e+14|1",
            "c": "no separators at all",
            "d": f"{name}|1|2|3|4|5|6|7",
        }
        for score, (rid, info) in enumerate(hostile.items()):
            r.zadd(f"{key}:queue", {rid: score})
            r.hset(f"{key}:entries", rid, info)
            r.zadd(f"{key}:deadlines", {rid: 99999999999999999})
        r.hset(f"{key}:levels", mapping={"5": 2, "3": 1})  # counts that drifted with them
        lease = await asyncio.wait_for(replica.acquire(policy, priority=5, timeout_s=5), 5)
        await replica.tick_pool(policy)
        assert r.zcard(f"{key}:queue") == 0 and r.hlen(f"{key}:entries") == 0
        bad_entries = r.hget(f"{key}:stats", "bad_entries")
        assert bad_entries is not None and int(bad_entries) >= 3
        assert r.hlen(f"{key}:levels") == 0  # the drained queue reset them
        assert r.hget(f"{key}:entries", lease.request_id) is None
        await replica.release(lease)
        # And a corrupt lease weight reads as one slot (counted), never an error.
        second = await replica.acquire(policy, priority=5, timeout_s=5)
        r.hset(f"{key}:lease_slots", second.request_id, "1e+14")
        await replica.release(second)
        await replica.tick_pool(policy)
        assert r.hgetall(f"{key}:inflight") == {}
    finally:
        await cluster.close()


def test_the_gateways_n_bound_is_the_engines():
    """The gateway image does not ship the engine, so it keeps its own copy of the engine's
    bound on ``n``; they must agree."""
    from slotserve.engine.http.choices import MAX_CHOICES as ENGINE_MAX_CHOICES
    from slotserve.gateway.http.completions import MAX_CHOICES

    assert MAX_CHOICES == ENGINE_MAX_CHOICES
