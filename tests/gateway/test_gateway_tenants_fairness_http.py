"""A tenant's fair share over HTTP: the keys file's tenant reaches admission (one gateway in this
process, in-process admission, a one-slot engine double over HTTP).

Tenant A holds the slot and queues six more requests; tenant B's one request, sent last, reaches
the engine first or second after the slot frees, not after A's six (first come, first served).
The per-tenant queue-wait histogram counts both tenants.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.gateway.gateway_support import pool

KEYS = "sk-a tenant=a\nsk-b tenant=b weight=1\n"


async def post(client: aiohttp.ClientSession, url: str, key: str, prompt: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    async with client.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_the_callers_tenant_gets_its_share_of_a_flooded_pool(gw, spawn, client, tmp_path):
    engine = spawn.double(slots=1, delay=0.25)
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    url = await gw([pool("m", [engine.url])], api_keys_file=keys)
    sent = [asyncio.create_task(post(client, url, "sk-a", "hold"))]
    await asyncio.sleep(0.1)  # the slot is A's
    for i in range(1, 7):
        sent.append(asyncio.create_task(post(client, url, "sk-a", f"a{i}")))
        await asyncio.sleep(0.02)
    sent.append(asyncio.create_task(post(client, url, "sk-b", "b1")))
    statuses = await asyncio.wait_for(asyncio.gather(*sent), 20)
    assert statuses == [200] * 8
    arrivals = engine.stats()["arrivals"]
    assert arrivals[0] == "hold"
    assert arrivals.index("b1") <= 2, arrivals  # first come, first served: 7
    async with client.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for tenant, count in (("a", 7), ("b", 1)):
        line = f'slotserve_gateway_tenant_queue_wait_seconds_count{{pool="m",tenant="{tenant}"}}'
        assert f"{line} {count}.0" in text
