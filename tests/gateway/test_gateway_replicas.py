"""Admission invariants with real gateway processes sharing one real Redis.

Engine doubles (real HTTP servers) record the peak number of requests they had in flight,
so "never more than 2" is observed at the engine, not inferred from the gateway's books.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp

from tests.gateway.gateway_support import pool, write_pools

LEASE_TTL = 2.0


def body(prompt: str, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, **extra}


async def post(session, url: str, payload: dict, headers: dict | None = None):
    started = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers or {}) as r:
        text = await r.read()
        return r.status, r.headers.get("Retry-After"), text, time.monotonic() - started


def session():
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    )


async def test_three_replicas_never_exceed_engine_slots(spawn, redis_server, tmp_path):
    engines = [spawn.double(slots=2, delay=0.04) for _ in range(2)]
    pools = write_pools(
        tmp_path / "p.yaml", [pool("m", [e.url for e in engines], maxQueueSize=1000)]
    )
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(3)]
    async with session() as s:
        results = await asyncio.gather(
            *(post(s, gateways[i % 3].url, body(f"r{i}", stream=i % 2 == 0)) for i in range(300))
        )
    statuses = Counter(status for status, *_ in results)
    assert statuses == {200: 300}, statuses
    stats = [e.stats() for e in engines]
    assert [st["max_inflight"] for st in stats] == [2, 2]  # full, and never more
    assert sum(st["num_requests"] for st in stats) == 300


async def test_queue_limit_and_timeout_hold_across_replicas(spawn, redis_server, tmp_path):
    engine = spawn.double(slots=2, delay=1.0)
    pools = write_pools(
        tmp_path / "p.yaml", [pool("m", [engine.url], maxQueueSize=10, queueTimeoutSeconds=2.5)]
    )
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(3)]
    async with session() as s:
        results = await asyncio.gather(
            *(post(s, gateways[i % 3].url, body(f"q{i}")) for i in range(40))
        )
    by_status = Counter(status for status, *_ in results)
    assert set(by_status) <= {200, 429, 503}, by_status
    # 2 run and at most 10 wait, whichever replica they came through; the rest: 429 at once.
    assert by_status[429] >= 40 - 12 - 2, by_status
    assert all(elapsed < 1.0 for status, _, _, elapsed in results if status == 429)
    assert all(int(retry) >= 1 for status, retry, *_ in results if status in (429, 503))
    # The queue drains 2 per second: waiters beyond ~2.5 s get 503 (queue timeout).
    timeouts = [elapsed for status, _, _, elapsed in results if status == 503]
    assert timeouts, by_status
    assert all(2.3 < t < 4.5 for t in timeouts), timeouts
    assert engine.stats()["max_inflight"] <= 2


async def test_fifo_within_priority_across_replicas(spawn, redis_server, tmp_path):
    engine = spawn.double(slots=1, delay=0.02)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url])])
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(3)]
    plan = [(f"n{i}", prio) for i, prio in enumerate([5, 5, 2, 5, 2, 9, 5, 2, 9, 5, 5, 2])]
    async with session() as s:
        blocker = asyncio.create_task(post(s, gateways[0].url, body("blocker", x_delay=1.0)))
        await asyncio.sleep(0.3)
        tasks = []
        for i, (name, prio) in enumerate(plan):
            headers = {"x-slotserve-priority": str(prio)}
            tasks.append(asyncio.create_task(post(s, gateways[i % 3].url, body(name), headers)))
            await asyncio.sleep(0.04)
        results = await asyncio.gather(blocker, *tasks)
    assert all(status == 200 for status, *_ in results)
    arrivals = engine.stats()["arrivals"]
    assert arrivals[0] == "blocker"
    assert arrivals[1:] == [name for name, _ in sorted(plan, key=lambda item: item[1])]


async def test_kill_9_of_a_replica_recovers_its_slots_and_queue_entries(
    spawn, redis_server, tmp_path
):
    engine = spawn.double(slots=2, delay=0.05)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url], maxQueueSize=3)])
    doomed, survivor = (spawn.gateway(pools, redis_server.url, LEASE_TTL) for _ in range(2))
    async with session() as s:
        # The doomed replica holds both slots (long requests) and all 3 queue places.
        doomed_reqs = [
            asyncio.create_task(post(s, doomed.url, body(f"d{i}", x_delay=8.0))) for i in range(5)
        ]
        await asyncio.sleep(0.5)
        survivor_ok = await post(s, survivor.url, body("s0", x_delay=0))
        assert survivor_ok[0] == 429  # queue is full, globally
        doomed.kill()  # SIGKILL: no release, no cancel, no goodbye
        killed_at = time.monotonic()
        await asyncio.gather(*doomed_reqs, return_exceptions=True)
        # The survivor keeps answering; within the lease TTL it gets the slots and queue back.
        # It comes back when told (Retry-After), as clients do: places promised to rejected
        # clients are held for them, so polling faster would not help.
        statuses, promised_until = [survivor_ok[0]], time.monotonic() + int(survivor_ok[1])
        while True:
            status, retry_after, *_ = await post(s, survivor.url, body("s1", x_delay=0))
            statuses.append(status)
            if status == 200:
                break
            assert status in (429, 503), status
            assert time.monotonic() - killed_at < LEASE_TTL * 2 + 3
            promised_until = time.monotonic() + int(retry_after)
            await asyncio.sleep(int(retry_after))
        recovered_after = time.monotonic() - killed_at
        await asyncio.sleep(max(0.0, promised_until - time.monotonic()))
        # Everything is back: 2 slots and 3 queue places serve 5 concurrent requests.
        results = await asyncio.gather(
            *(post(s, survivor.url, body(f"s{i}", x_delay=0.3)) for i in range(5))
        )
    assert recovered_after < LEASE_TTL + 2.5, recovered_after
    assert [r[0] for r in results] == [200] * 5
    assert engine.stats()["max_inflight"] <= 2


async def test_redis_restart_gives_503_then_recovers_without_gateway_restart(
    spawn, redis_server, tmp_path
):
    engine = spawn.double(slots=2, delay=0.02)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url])])
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(2)]
    async with session() as s:
        for g in gateways:
            assert (await post(s, g.url, body("before")))[0] == 200
        redis_server.stop()
        for g in gateways:
            status, retry, text, elapsed = await post(s, g.url, body("during"))
            assert status == 503 and int(retry) >= 1, (status, text)
            assert b"unavailable" in text
            assert elapsed < 3
        redis_server.start()
        deadline = time.monotonic() + 10
        recovered: set[int] = set()
        while len(recovered) < 2 and time.monotonic() < deadline:
            for i, g in enumerate(gateways):
                if (await post(s, g.url, body("after")))[0] == 200:
                    recovered.add(i)
            await asyncio.sleep(0.1)
        assert recovered == {0, 1}
        results = await asyncio.gather(
            *(post(s, gateways[i % 2].url, body(f"a{i}")) for i in range(40))
        )
    assert Counter(r[0] for r in results) == {200: 40}
    assert all(g.popen.poll() is None for g in gateways)  # never restarted
    assert engine.stats()["max_inflight"] <= 2
