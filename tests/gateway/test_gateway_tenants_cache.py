"""The prefix probe from issue 26, closed: behind a gateway, tenant B sending tenant A's prompt
finds nothing of A's in a real engine's prefix cache (its hit counter does not move), even when
B sends the salt header itself; A's own repeat hits."""

from __future__ import annotations

import aiohttp
from gateway_support import pool, write_pools
from test_gateway_e2e_engines import start_engine, wait_ready

from slotserve.contracts.headers import CACHE_SALT_HEADER

KEYS = "sk-a tenant=team-a\nsk-b tenant=team-b\n"
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
