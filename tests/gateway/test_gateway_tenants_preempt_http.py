"""Tenant preemption end to end (issue 26): a gateway in front of a real one-slot engine.

Tenant A's long streamed answer holds the engine's only slot. With the pool's preemptForShare on,
tenant B's request is sent at once as a preempting grant: the engine preempts A's answer (its
tenant-preemption counter moves, not the KV one), B's answer comes back while A's is still
running, and A's stream then completes, every token there. With it off, a hostile B that sends the
internal ``x-slotserve-preempt`` header itself preempts nothing: the gateway never forwards it.
"""

from __future__ import annotations

import asyncio

import aiohttp

from slotserve.contracts.headers import PREEMPT_HEADER
from tests.gateway.gateway_support import pool, write_pools
from tests.gateway.test_gateway_e2e_engines import start_engine, wait_ready

KEYS = "sk-a tenant=team-a\nsk-b tenant=team-b\n"
LONG_TOKENS = 220  # with its prompt, within the engine's max_model_len (256)


async def counter(session: aiohttp.ClientSession, engine_url: str, name: str) -> float:
    async with session.get(f"{engine_url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def long_answer(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> int:
    """A's streamed answer: its number of tokens, once it ends; ``started`` at its first."""
    payload = {
        "model": "tiny",
        "prompt": "Tell a long story.",
        "max_tokens": LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": "Bearer sk-a"}
    num_tokens = 0
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                num_tokens += 1
                started.set()
    return num_tokens


async def short_answer(session: aiohttp.ClientSession, url: str, **headers: str) -> None:
    payload = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": "Bearer sk-b", **headers}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


async def race(session: aiohttp.ClientSession, url: str, **headers: str) -> tuple[bool, int]:
    """A's long answer, B's short one sent once A streams: whether B ended before A, and A's
    number of tokens."""
    started = asyncio.Event()
    long_task = asyncio.create_task(long_answer(session, url, started))
    await asyncio.wait({long_task, asyncio.create_task(started.wait())}, timeout=60,
                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    assert started.is_set(), long_task.exception() if long_task.done() else "A never streamed"
    await asyncio.wait_for(short_answer(session, url, **headers), 120)
    b_first = not long_task.done()
    return b_first, await asyncio.wait_for(long_task, 120)


async def test_b_preempts_a_running_answer_and_a_hostile_header_preempts_nothing(
    spawn, tiny_model_dir, tmp_path
):
    engine_url = wait_ready(start_engine(spawn, tiny_model_dir, "--max-batch-size", "1"))
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    timeout = aiohttp.ClientTimeout(total=300)
    tenant_preemptions = "slotserve_tenant_preemptions_total"
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Off, and B names A itself: the header is dropped, so B waits for A's answer to end.
        pools = write_pools(
            tmp_path / "off.yaml", [pool("tiny", [engine_url], preemptForShare=False)]
        )
        gateway = spawn.gateway(pools, extra=["--api-keys-file", str(keys)])
        b_first, num_tokens = await race(session, gateway.url, **{PREEMPT_HEADER: "team-a"})
        assert (b_first, num_tokens) == (False, LONG_TOKENS)
        assert await counter(session, engine_url, tenant_preemptions) == 0
        # On (the default): B's request preempts A's answer at once.
        pools = write_pools(tmp_path / "on.yaml", [pool("tiny", [engine_url])])
        gateway = spawn.gateway(pools, extra=["--api-keys-file", str(keys)])
        b_first, num_tokens = await race(session, gateway.url)
        assert (b_first, num_tokens) == (True, LONG_TOKENS)
        assert await counter(session, engine_url, tenant_preemptions) == 1
        assert await counter(session, engine_url, "vllm:num_preemptions_total") == 0
