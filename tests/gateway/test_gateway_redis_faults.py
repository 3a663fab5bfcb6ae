"""Every Redis failure is a clean, bounded 503 and service resumes by itself.

Faults are made with real Redis features, never a fake: ``maxmemory`` with ``noeviction`` (OOM),
``REPLICAOF`` (READONLY, then a failover to an empty primary), ``SCRIPT FLUSH`` (NOSCRIPT) and
SIGSTOP of the server process (a hung Redis: timeouts).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from slotserve.gateway.admission.backends.redis import CALL_TIMEOUT_S
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import BackendUnavailableError, PoolPolicy
from tests.gateway.admission_cluster import Cluster
from tests.gateway.gateway_support import pool, write_pools
from tests.support import RedisServer

POOL = PoolPolicy("m", max_queue_size=10, queue_timeout_s=10)


async def admitted(replica: Admission, timeout_s: float = 10) -> None:
    """One acquire + release succeeds within ``timeout_s`` (503s before that are fine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            lease = await replica.acquire(POOL, priority=5, timeout_s=2)
            await replica.release(lease)
            return
        except BackendUnavailableError:
            assert time.monotonic() < deadline, "admission did not resume"
            await asyncio.sleep(0.1)


async def fails_fast(replica: Admission, limit_s: float) -> None:
    started = time.monotonic()
    with pytest.raises(BackendUnavailableError):
        await replica.acquire(POOL, priority=5, timeout_s=5)
    assert time.monotonic() - started < limit_s
    assert not replica.backend_ok  # the admission_backend_up gauge reads this


async def cross_replica_grant_arrives(a: Admission, b: Admission) -> None:
    """The grant listener still works: a grant made by ``a``'s release reaches ``b``."""
    holder = await a.acquire(POOL, priority=5, timeout_s=5)
    waiter = asyncio.create_task(b.acquire(POOL, priority=5, timeout_s=5))
    await asyncio.sleep(0.2)
    await a.release(holder)
    await b.release(await asyncio.wait_for(waiter, 5))


@pytest.fixture
async def cluster_on(redis_server):
    cl = Cluster("redis", redis_server.url)
    cl.serve(POOL, ("http://a", 1, 0.0))
    try:
        yield cl
    finally:
        await cl.close()


async def redis_cmd(url: str, *args: str) -> object:
    client = aioredis.Redis.from_url(url)
    try:
        return await client.execute_command(*args)
    finally:
        await client.aclose()


async def _oom(server: RedisServer) -> Callable[[], Awaitable[None]]:
    await redis_cmd(server.url, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    await redis_cmd(server.url, "CONFIG", "SET", "maxmemory", "1")

    async def heal() -> None:
        await redis_cmd(server.url, "CONFIG", "SET", "maxmemory", "0")

    return heal


async def _script_flush(server: RedisServer) -> Callable[[], Awaitable[None]]:
    await redis_cmd(server.url, "SCRIPT", "FLUSH")

    async def heal() -> None:
        return None

    return heal


async def test_oom_is_a_fast_503_and_heals(cluster_on, redis_server):
    a, b = await cluster_on.replica(), await cluster_on.replica()
    heal = await _oom(redis_server)
    await fails_fast(a, 1.0)
    await heal()
    await admitted(a)
    assert a.backend_ok
    await cross_replica_grant_arrives(a, b)


async def test_noscript_is_reloaded_without_a_failure(cluster_on, redis_server):
    a = await cluster_on.replica()
    await _script_flush(redis_server)
    lease = await a.acquire(POOL, priority=5, timeout_s=2)
    await a.release(lease)
    assert a.backend_ok


async def test_hung_redis_costs_one_bounded_wait(cluster_on, redis_server):
    a, b = await cluster_on.replica(), await cluster_on.replica()
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        await fails_fast(a, CALL_TIMEOUT_S + 1.5)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    await admitted(a)
    await cross_replica_grant_arrives(a, b)


async def test_failover_to_an_empty_primary_readonly_then_no_over_admission(
    cluster_on, redis_server, tmp_path
):
    """REPLICAOF an empty server: READONLY errors, then (promoted) its data is gone."""
    holder, other = await cluster_on.replica(), await cluster_on.replica()
    lease = await holder.acquire(POOL, priority=5, timeout_s=5)
    primary = RedisServer(tmp_path / "primary")
    primary.start()
    try:
        await redis_cmd(redis_server.url, "REPLICAOF", "127.0.0.1", str(primary.port))
        deadline = time.monotonic() + 10
        while (await redis_cmd(redis_server.url, "DBSIZE")) != 0:  # synced: empty now
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await fails_fast(other, 1.0)  # READONLY
        await redis_cmd(redis_server.url, "REPLICAOF", "NO", "ONE")  # promoted, empty
    finally:
        primary.stop()
    waiter = asyncio.create_task(other.acquire(POOL, priority=5, timeout_s=20))
    promoted_at = time.monotonic()
    while time.monotonic() - promoted_at < 2.5:  # the only slot is still held
        await asyncio.sleep(0.05)
        if waiter.done():
            assert isinstance(waiter.exception(), BackendUnavailableError)
            waiter = asyncio.create_task(other.acquire(POOL, priority=5, timeout_s=20))
    assert not waiter.done()
    await holder.release(lease)
    await other.release(await asyncio.wait_for(waiter, 5))
    assert holder.backend_ok and other.backend_ok


def _http(url: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _backend_up(gateway_url: str) -> float:
    _, _, text = _http(f"{gateway_url}/metrics")
    for line in text.decode().splitlines():
        if line.startswith("slotserve_gateway_admission_backend_up "):
            return float(line.split()[1])
    raise AssertionError("no admission_backend_up gauge")


async def test_gateway_answers_openai_503_with_retry_after_and_gauge(spawn, redis_server, tmp_path):
    engine = spawn.double(slots=2, delay=0.01)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url])])
    gateway = spawn.gateway(pools, redis_server.url)
    completion = {"model": "m", "prompt": "x", "max_tokens": 2}
    url = f"{gateway.url}/v1/completions"
    assert (await asyncio.to_thread(_http, url, completion))[0] == 200
    heal = await _oom(redis_server)
    status, headers, text = await asyncio.to_thread(_http, url, completion)
    assert status == 503, text
    assert int(headers["Retry-After"]) >= 1
    assert json.loads(text)["error"]["code"] == "admission_backend_unavailable"
    assert await asyncio.to_thread(_backend_up, gateway.url) == 0
    await heal()
    deadline = time.monotonic() + 10
    while (await asyncio.to_thread(_http, url, completion))[0] != 200:
        assert time.monotonic() < deadline, "the gateway did not resume"
        await asyncio.sleep(0.2)
    assert await asyncio.to_thread(_backend_up, gateway.url) == 1
    assert engine.stats()["max_inflight"] <= 2
