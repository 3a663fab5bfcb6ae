"""End to end: real `slotserve engine` processes (tiny model) behind 2 gateway replicas + Redis,
driven by the official openai client with streaming.

While the requests run, each engine's own ``GET /load`` is sampled: the gateways must never put
more requests on an engine than its slots (nothing waits inside the engine).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import httpx
import pytest
from openai import AsyncOpenAI

from tests.gateway.gateway_support import SLOTSERVE, Proc, pool, write_pools
from tests.support import free_port, http_ok, wait_until

pytestmark = pytest.mark.slow

NUM_SLOTS = 2


def start_engine(spawn, model_dir, *extra: str) -> Proc:
    port = free_port()
    argv = [
        str(SLOTSERVE), "engine", "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
        "--max-batch-size", str(NUM_SLOTS), "--max-model-len", "256", *extra,
    ]  # fmt: skip
    return spawn._start(Proc, "engine", argv, port)


def wait_ready(proc: Proc) -> str:
    try:
        wait_until(lambda: http_ok(f"{proc.url}/ready"), 180, interval=0.2, what="engine /ready")
    except TimeoutError:
        raise AssertionError(f"engine did not start:\n{proc.logs()}") from None
    return proc.url


class LoadSampler(threading.Thread):
    """Samples GET /load of each engine until stopped; keeps the worst it saw."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.max_running = dict.fromkeys(urls, 0)
        self.max_waiting = dict.fromkeys(urls, 0)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for url in self.urls:
                try:
                    with urllib.request.urlopen(f"{url}/load", timeout=2) as resp:
                        load = json.loads(resp.read())
                except OSError:
                    continue
                self.max_running[url] = max(self.max_running[url], load["running"])
                self.max_waiting[url] = max(self.max_waiting[url], load["waiting"])
            time.sleep(0.01)


async def test_openai_client_streams_through_two_replicas(
    spawn, redis_server, tiny_model_dir, tmp_path
):
    procs = [start_engine(spawn, tiny_model_dir) for _ in range(2)]  # load in parallel
    engines = [wait_ready(proc) for proc in procs]
    pools = write_pools(tmp_path / "pools.yaml", [pool("tiny", engines)])
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(2)]
    clients = [
        AsyncOpenAI(base_url=f"{g.url}/v1", api_key="unused", max_retries=0) for g in gateways
    ]
    sampler = LoadSampler(engines)
    sampler.start()

    async def stream_chat(i: int) -> tuple[str, str | None]:
        stream = await clients[i % 2].chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    try:
        results = await asyncio.wait_for(asyncio.gather(*(stream_chat(i) for i in range(12))), 120)
        completion = await clients[1].completions.create(model="tiny", prompt="Hello", max_tokens=5)
        models = await clients[0].models.list()
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
        for client in clients:
            await client.close()
    assert all(text and finish in ("stop", "length") for text, finish in results), results
    assert completion.choices[0].text
    assert [m.id for m in models.data] == ["tiny"]
    assert max(sampler.max_running.values()) <= NUM_SLOTS
    assert max(sampler.max_waiting.values()) == 0  # the gateways never over-filled an engine
    assert max(sampler.max_running.values()) == NUM_SLOTS  # and did use the slots


DELAY_S = 0.4


async def _ttft(client: httpx.AsyncClient, gateway_url: str) -> float:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True}
    started = time.monotonic()
    async with client.stream("POST", f"{gateway_url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                return time.monotonic() - started
    raise AssertionError("the stream ended without a token")


async def test_a_lone_request_in_a_dynamic_pool_waits_one_queue_delay_not_two(
    spawn, redis_server, tiny_model_dir, tmp_path
):
    """The engine gathers the batch; the gateway passes the request straight on, so a request
    alone pays the queue delay once (both admission backends)."""
    delay_us = str(int(DELAY_S * 1e6))
    proc = start_engine(
        spawn, tiny_model_dir, "--policy", "dynamic", "--max-queue-delay-microseconds", delay_us
    )
    dynamic = pool("tiny", [wait_ready(proc)])
    dynamic["batching"] = {
        "policy": "dynamic",
        "maxBatchSize": NUM_SLOTS,
        "maxQueueDelayMicroseconds": int(delay_us),
    }
    pools = write_pools(tmp_path / "pools.yaml", [dynamic])
    gateways = [spawn.gateway(pools, redis_server.url), spawn.gateway(pools)]
    async with httpx.AsyncClient(timeout=30) as client:
        for gateway in gateways:
            await _ttft(client, gateway.url)  # first-call costs out of the measurement
            ttfts = [await _ttft(client, gateway.url) for _ in range(3)]
            # Every call pays at least the engine's gathering. A busy machine only adds to a
            # call, while paying the delay twice would put every call past 2x: the quickest
            # call says which happened.
            assert min(ttfts) >= 0.95 * DELAY_S, (gateway.url, ttfts)
            assert min(ttfts) < 1.6 * DELAY_S, (gateway.url, ttfts)
