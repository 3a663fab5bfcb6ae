"""Clients that write a request and close at once leave no slot behind (real processes).

The report: 5 write-and-close requests against a 1-slot engine made the next request wait
9.8 s (a lease TTL), because a grant made while the enqueue step was in flight had no owner.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.gateway.gateway_support import pool, write_pools


async def write_and_close(url: str, payload: dict) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(payload).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_write_and_close_requests_leave_the_slot_free(spawn, tmp_path, request, backend):
    engine = spawn.double(slots=1, delay=0.05)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url])])
    redis_url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    gateway = spawn.gateway(pools, redis_url, lease_ttl=10.0)
    payload = {"model": "m", "prompt": "x", "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for _ in range(5):
            await write_and_close(gateway.url, payload)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        async with s.post(f"{gateway.url}/v1/completions", json=payload) as r:
            assert r.status == 200
            await r.read()
        waited = time.monotonic() - started
    print(f"{backend}: next request answered after {waited * 1000:.0f} ms")
    assert waited < 1.0, waited  # was a lease TTL (10 s)
    assert engine.stats()["max_inflight"] <= 1
