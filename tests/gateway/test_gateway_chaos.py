"""Chaos: 3 gateway replicas, one Redis, 2 engine doubles with 2 slots each, ~2,000 requests.

Clients disconnect at random moments (queued, proxied, mid-stream) and otherwise come back when
told (Retry-After) before their next request. In the middle one replica is killed with SIGKILL
and Redis restarts without persistence (its data is lost); later FLUSHALL empties it again while
it stays up. Counted at the engines: in flight never above slots. Every request ends 200, 429 or
503 with Retry-After, or was cancelled by its client (or was in flight at the killed replica).
Afterwards every slot is usable again within one lease TTL.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import aiohttp
import pytest
import redis.asyncio as aioredis

from tests.gateway.gateway_support import pool, write_pools

LEASE_TTL = 2.0
NUM_REQUESTS = 2000
CONCURRENCY = 48


@pytest.mark.slow
async def test_chaos_slots_hold_and_every_request_ends_cleanly(spawn, redis_server, tmp_path):
    engines = [spawn.double(slots=2, delay=0.04) for _ in range(2)]
    pools = write_pools(
        tmp_path / "p.yaml",
        [pool("m", [e.url for e in engines], maxQueueSize=24, queueTimeoutSeconds=3)],
    )
    gateways = [spawn.gateway(pools, redis_server.url, LEASE_TTL) for _ in range(3)]
    live = [True, True, True]
    rng = random.Random(2026)
    outcomes: Counter[str] = Counter()
    bad: list[str] = []
    done = 0

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        g = rng.choice([k for k in range(3) if live[k]])
        stream = rng.random() < 0.3
        payload = {"model": "m", "prompt": f"c{i}", "max_tokens": 4, "stream": stream}
        cancel_after = rng.uniform(0.0, 0.3) if rng.random() < 0.2 else None
        pause_s = [0]

        async def call() -> None:
            async with s.post(f"{gateways[g].url}/v1/completions", json=payload) as r:
                await r.read()
                retry_after = r.headers.get("Retry-After")
                if r.status == 200:
                    outcomes["200"] += 1
                elif r.status in (429, 503) and retry_after and int(retry_after) >= 1:
                    outcomes[str(r.status)] += 1
                    pause_s[0] = int(retry_after)  # this client comes back when told
                else:
                    bad.append(f"{r.status} {retry_after} {(await r.text())[:200]}")

        try:
            if cancel_after is None:
                await asyncio.wait_for(call(), 30)
            else:
                try:
                    await asyncio.wait_for(call(), cancel_after)
                except TimeoutError:
                    outcomes["cancelled by client"] += 1
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            if live[g]:
                bad.append(f"connection error from a live replica {g}")
            else:
                outcomes["lost with the killed replica"] += 1
        await asyncio.sleep(pause_s[0])

    async def chaos() -> None:
        while done < NUM_REQUESTS * 0.35:
            await asyncio.sleep(0.05)
        live[2] = False
        gateways[2].kill()  # SIGKILL
        while done < NUM_REQUESTS * 0.6:
            await asyncio.sleep(0.05)
        redis_server.stop()  # no persistence: it comes back empty
        await asyncio.sleep(0.5)
        redis_server.start()
        while done < NUM_REQUESTS * 0.8:
            await asyncio.sleep(0.05)
        client = aioredis.Redis.from_url(redis_server.url)  # and loses it again, while up
        await client.flushall()
        await client.aclose()

    async def worker(s: aiohttp.ClientSession, queue: asyncio.Queue[int]) -> None:
        nonlocal done
        while not queue.empty():
            await one(s, queue.get_nowait())
            done += 1

    started = time.monotonic()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(NUM_REQUESTS):
        queue.put_nowait(i)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        chaos_task = asyncio.create_task(chaos())
        await asyncio.wait_for(asyncio.gather(*(worker(s, queue) for _ in range(CONCURRENCY))), 150)
        await asyncio.wait_for(chaos_task, 10)
        elapsed = time.monotonic() - started

        # Afterwards: within one lease TTL, all 4 slots take 4 long requests at once.
        ended_at = time.monotonic()
        while True:
            slow = {"model": "m", "prompt": "after", "max_tokens": 2, "x_delay": 0.8}
            posts = [
                s.post(f"{gateways[k % 2].url}/v1/completions", json=slow, headers={})
                for k in range(4)
            ]
            responses = await asyncio.gather(*posts)
            waits = []
            for r in responses:
                await r.read()
                waits.append(float(r.headers.get("x-slotserve-queue-wait-ms", "1e9")))
                r.release()
            if all(w < 300 for w in waits):
                break
            assert time.monotonic() - ended_at < LEASE_TTL + 2, waits
        recovered_after = time.monotonic() - ended_at

    stats = [e.stats() for e in engines]
    print(
        f"chaos: {dict(outcomes)} in {elapsed:.0f} s; engines max in flight "
        f"{[st['max_inflight'] for st in stats]}, aborted {[st['num_aborted'] for st in stats]}; "
        f"all slots usable {recovered_after:.1f} s after the end"
    )
    assert not bad, bad[:10]
    assert sum(outcomes.values()) == NUM_REQUESTS
    # Served through the kill and both losses of Redis. The rest is 429s (48 clients against 4
    # slots and a queue of 24) and 503s, whose share grows when the host is slow: 58% served
    # alone, 48% inside a loaded suite on a 2-core Zen 3 (where "over half" failed once).
    assert outcomes["200"] > NUM_REQUESTS * 0.4
    assert outcomes["cancelled by client"] > 100
    assert [st["max_inflight"] for st in stats] == [2, 2]  # full, and never more
    assert recovered_after <= LEASE_TTL + 0.5
