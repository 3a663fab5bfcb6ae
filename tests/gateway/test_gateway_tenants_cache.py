"""The prefix probe from issue 26, closed: behind a gateway, tenant B sending tenant A's prompt
finds nothing of A's in a real engine's prefix cache (its hit counter does not move), even when
B sends the salt header itself; A's own repeat hits. And a streamed answer's usage event counts
its tenant's tokens."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from slotserve.contracts.headers import CACHE_SALT_HEADER
from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_e2e_engines import start_engine, wait_ready

KEYS = "sk-a tenant=team-a\nsk-b tenant=team-b\nsk-c tenant=team-c tpm=100000\n"
PROMPT = "Tenant A's confidential system prompt: quarterly numbers follow. " * 8  # ~100 tokens


async def prefix_hits(session: aiohttp.ClientSession, engine_url: str) -> float:
    async with session.get(f"{engine_url}/metrics") as resp:
        text = await resp.text()
    lines = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def complete(session: aiohttp.ClientSession, url: str, key: str, **headers: str) -> int:
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}", **headers}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_tenant_b_gets_no_hit_on_tenant_a_s_prompt(spawn, tiny_model_dir, tmp_path):
    engine = start_engine(spawn, tiny_model_dir)
    engine_url = wait_ready(engine)
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    pools = write_pools(tmp_path / "p.yaml", [pool("tiny", [engine_url])])
    gateway = spawn.gateway(pools, extra=["--api-keys-file", str(keys)])
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        assert await complete(session, gateway.url, "sk-a") == 200
        before = await prefix_hits(session, engine_url)
        # B probes with A's prompt, even naming A's salt: the gateway sends B's own.
        spoof = {CACHE_SALT_HEADER: "team-a"}
        assert await complete(session, gateway.url, "sk-b", **spoof) == 200
        assert await prefix_hits(session, engine_url) == before
        assert await complete(session, gateway.url, "sk-a") == 200
        assert await prefix_hits(session, engine_url) - before >= 90
        usage = await streamed_usage(session, gateway.url, "sk-c")
        assert usage["total_tokens"] > 90
        for _ in range(50):  # bounded: counted as the gateway's handler ends, after the last byte
            counted = await tenant_tokens(session, gateway.url, "team-c")
            if counted:
                break
            await asyncio.sleep(0.02)
        assert counted == usage["total_tokens"]


async def streamed_usage(session: aiohttp.ClientSession, url: str, key: str) -> dict:
    payload = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {key}"}
    usage: dict[str, int] = {}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


async def tenant_tokens(session: aiohttp.ClientSession, url: str, tenant: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    prefix = f'slotserve_gateway_tenant_tokens_total{{kind="counted",tenant="{tenant}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))
