"""Prefix-aware routing over real HTTP (issue 29): gateway replicas sharing a real Redis route a
request to the engine whose /load reports its prefix; a hostile /load key list or session header
costs nothing but that engine or that request; and, with real engines (tiny model), each next
turn of a conversation lands on the engine that holds its history."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from slotserve.contracts.prefix_keys import chat_chain
from tests.gateway.gateway_support import Double, pool, write_pools
from tests.gateway.test_gateway_e2e_engines import start_engine, wait_ready
from tests.support import wait_until

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
KEYS = list(chat_chain(MESSAGES, "default").keys)  # the default tenant is the salt


def routed_pool(endpoints: list[str], **routing: object) -> dict:
    spec = pool("double", endpoints)
    spec["routing"] = routing
    return spec


async def chat(
    client: aiohttp.ClientSession, url: str, messages: list, model: str = "double", **extra
) -> tuple[int, dict]:
    headers = extra.pop("headers", {})
    body = {"model": model, "messages": messages, "max_tokens": 4, **extra}
    async with client.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def polled(double: Double, times: int = 3) -> None:
    """Wait until every gateway had time to read ``double``'s /load again."""
    start = double.stats()["num_load_polls"]
    wait_until(lambda: double.stats()["num_load_polls"] >= start + times, 10, what="polls")


async def test_requests_go_to_the_engine_reporting_their_prefix(spawn, redis_server, tmp_path):
    doubles = [spawn.double(slots=2) for _ in range(3)]
    urls = [d.url for d in doubles]
    pools = write_pools(tmp_path / "pools.yaml", [routed_pool(urls)])
    off = write_pools(tmp_path / "off.yaml", [routed_pool(urls, prefixAware=False)])
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(2)]
    by_load = spawn.gateway(off)
    doubles[2].control(prefix_keys=KEYS[:1])  # the system prompt only
    polled(doubles[2], times=6)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        for index in range(4):
            status, _ = await chat(client, gateways[index % 2].url, MESSAGES)
            assert status == 200
        assert doubles[2].stats()["num_requests"] == 4
        assert doubles[0].stats()["num_requests"] == 0
        # Routing off: the same request goes by load (the first of the idle engines).
        assert (await chat(client, by_load.url, MESSAGES))[0] == 200
        assert doubles[0].stats()["num_requests"] == 1


async def test_a_hostile_load_report_makes_only_that_engine_broken(spawn, redis_server, tmp_path):
    doubles = [spawn.double(slots=2, delay=0.3) for _ in range(3)]
    pools = write_pools(tmp_path / "pools.yaml", [routed_pool([d.url for d in doubles])])
    doubles[1].control(prefix_keys=[*KEYS, "NOT-HEX-KEY"])
    doubles[2].control(prefix_keys=[f"{i:016x}" for i in range(5000)])  # past the bound
    gateway = spawn.gateway(pools, redis_server.url)
    polled(doubles[1])
    polled(doubles[2])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        results = await asyncio.gather(*(chat(client, gateway.url, MESSAGES) for _ in range(6)))
    assert all(status == 200 for status, _ in results)
    assert doubles[0].stats()["num_requests"] == 6  # the two liars got nothing (not even KEYS)
    assert doubles[1].stats()["num_requests"] == doubles[2].stats()["num_requests"] == 0


async def test_session_keys_are_bounded(spawn, tmp_path):
    double = spawn.double(slots=2)
    gateway = spawn.gateway(write_pools(tmp_path / "pools.yaml", [routed_pool([double.url])]))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        status, body = await chat(
            client, gateway.url, MESSAGES, headers={"x-session-id": "s" * 257}
        )
        assert status == 400 and body["error"]["code"] == "invalid_header", body
        assert "x-session-id" in body["error"]["message"]
        status, _ = await chat(client, gateway.url, MESSAGES, headers={"x-session-id": "s" * 256})
        assert status == 200
        # OpenAI's user field is hashed whatever its length (the body's own bound holds it).
        assert (await chat(client, gateway.url, MESSAGES, user="u" * 100_000))[0] == 200
        assert (await chat(client, gateway.url, MESSAGES, user={"odd": 1}))[0] == 200
    assert double.stats()["num_requests"] == 3


def load_keys(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/load", timeout=5) as resp:
        return set(json.loads(resp.read())["prefix_keys"])


@pytest.mark.slow
async def test_each_turn_lands_on_the_engine_holding_its_history(
    spawn, redis_server, tiny_model_dir, tmp_path
):
    procs = [start_engine(spawn, tiny_model_dir) for _ in range(3)]
    engines = [wait_ready(proc) for proc in procs]
    spec = pool("tiny", engines)
    spec["routing"] = {"sessionHeader": "", "sessionFromUser": False}  # by prefix alone
    pools = write_pools(tmp_path / "pools.yaml", [spec])
    gateways = [spawn.gateway(pools, redis_server.url) for _ in range(2)]
    histories = [
        [{"role": "system", "content": f"You are assistant number {i}. " * 8}] for i in range(3)
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:

        async def turn(index: int, via: int, **extra: object) -> None:
            history = histories[index]
            history.append({"role": "user", "content": f"Question {len(history)}?"})
            status, body = await chat(client, gateways[via].url, history, model="tiny", **extra)
            assert status == 200, body
            answer = body["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer})

        # First turns together, long enough to overlap: each lands on its own engine.
        long = {"max_tokens": 48, "ignore_eos": True}
        await asyncio.gather(*(turn(i, i % 2, **long) for i in range(3)))
        homes = []
        for history in histories:
            keys = set(chat_chain(history, "default").keys)
            wait_until(lambda k=keys: any(k <= load_keys(u) for u in engines), 10, what="keys")
            homes.append(next(u for u in engines if keys <= load_keys(u)))
        assert len(set(homes)) == 3
        # Next turns one at a time through the other replica: by load all three would go to the
        # first engine; by prefix each goes home, and its row there now holds the new turn.
        for index in range(3):
            await asyncio.sleep(0.6)  # the gateways' next /load polls
            await turn(index, (index + 1) % 2)
            keys = set(chat_chain(histories[index], "default").keys)
            wait_until(lambda k=keys, i=index: k <= load_keys(homes[i]), 10, what="next turn")
