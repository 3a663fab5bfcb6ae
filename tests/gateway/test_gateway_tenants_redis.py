"""Tenant quotas fleet-wide: two gateway processes sharing one real Redis hold each tenant to one
limit, and a replica killed with places held loses them after one lease TTL."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import redis

from tests.gateway.gateway_support import pool, write_pools

LEASE_TTL = 2.0
KEYS = """\
sk-a tenant=team-a rpm=4
sk-b tenant=team-b max-inflight=2
sk-c tenant=team-c tpm=0
"""


async def post(session: aiohttp.ClientSession, url: str, key: str, **extra):
    payload = {"model": "m", "prompt": "hi", "max_tokens": 2, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        answer = await resp.json()
        code = answer["error"]["code"] if resp.status != 200 else ""
        return resp.status, resp.headers.get("Retry-After"), code


def fleet(spawn, redis_server, tmp_path, delay: float = 0.02):
    engine = spawn.double(slots=16, delay=delay)
    pools = write_pools(tmp_path / "p.yaml", [pool("m", [engine.url])])
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    extra = ["--api-keys-file", str(keys)]
    return [
        spawn.gateway(pools, redis_server.url, lease_ttl=LEASE_TTL, extra=extra) for _ in range(2)
    ]


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))


async def test_rpm_holds_across_replicas_with_the_refill_s_retry_after(
    spawn, redis_server, tmp_path
):
    gateways = fleet(spawn, redis_server, tmp_path)
    async with session() as s:
        results = [await post(s, gateways[i % 2].url, "sk-a") for i in range(6)]
        zero = await post(s, gateways[1].url, "sk-c")
    assert [status for status, *_ in results] == [200] * 4 + [429] * 2
    for _, retry_after, code in results[4:]:
        # 4 per minute: one request refills in 15 s, on either replica.
        assert code == "requests_per_minute" and 14 <= int(retry_after) <= 15
    assert zero == (429, None, "insufficient_quota")
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    tenant_keys = client.keys("slotserve:tenant:*")
    assert tenant_keys == ["slotserve:tenant:team-a:rpm"]  # prefixed; nothing for the others
    assert 0 < client.pttl(tenant_keys[0]) <= 61_000  # absent again once it would be full
    level, at = client.hmget(tenant_keys[0], "level", "at")
    assert isinstance(level, str) and isinstance(at, str)
    # Exact integers, never an exponent: less than one request left (in 1/60,000 units).
    assert level.isdigit() and int(level) < 60_000 and at.isdigit()


async def test_max_inflight_across_replicas_and_a_killed_replica_s_places_expire(
    spawn, redis_server, tmp_path
):
    gateways = fleet(spawn, redis_server, tmp_path, delay=1.0)
    async with session() as s:
        results = await asyncio.gather(*(post(s, gateways[i % 2].url, "sk-b") for i in range(6)))
        statuses = sorted(status for status, *_ in results)
        assert statuses == [200, 200, 429, 429, 429, 429]
        assert {code for _, _, code in results if code} == {"max_inflight"}
        assert (await post(s, gateways[1].url, "sk-b"))[0] == 200  # both released exactly
        # Replica 0 dies holding both places (its requests take 20 s).
        held = [asyncio.create_task(post(s, gateways[0].url, "sk-b", x_delay=20)) for _ in range(2)]
        await asyncio.sleep(0.5)
        assert (await post(s, gateways[1].url, "sk-b", x_delay=0))[2] == "max_inflight"
        gateways[0].kill(signal.SIGKILL)
        killed_at = time.monotonic()
        while (await post(s, gateways[1].url, "sk-b", x_delay=0))[0] != 200:
            assert time.monotonic() - killed_at < 3 * LEASE_TTL, "places of a dead replica held"
            await asyncio.sleep(0.1)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_the_lua_buckets_decide_as_the_in_process_twin(redis_server):
    """The same calls on both stores give the same decisions (rates low enough that the few
    milliseconds between the two calls refill nothing that matters)."""
    from slotserve.gateway.admission.quotas import InProcessQuotas
    from slotserve.gateway.admission.quotas_redis import RedisQuotas
    from slotserve.gateway.admission.tenants import Tenant

    redis_store = RedisQuotas(redis_server.url, "twin")
    memory = InProcessQuotas()
    tenant = Tenant("t", max_inflight=3, requests_per_minute=5, tokens_per_minute=120)
    calls = [("take", f"r{i}", cost) for i, cost in enumerate([10, 50, 70, 1, 0, 5, 30])]
    calls[3:3] = [("charge", "", -60), ("release", "r0", 0), ("release", "r1", 0)]
    calls += [("charge", "", 500), ("take", "late", 1)]
    decisions = []
    for store in (redis_store, memory):
        seen = []
        for kind, rid, amount in calls:
            if kind == "take":
                refusal = await store.take(tenant, rid, amount)
                seen.append(None if refusal is None else (refusal.reason, refusal.retry_after_s))
            elif kind == "charge":
                await store.charge(tenant, amount)
            else:
                await store.release(tenant, rid)
        decisions.append(seen)
    await redis_store.close()
    assert decisions[0] == decisions[1]
    # 120 tokens a minute: 10 + 50 taken, 70 more waits 5 s; 60 given back lets three small
    # ones in (3 in flight); the 6th request of a 5-a-minute bucket waits 12 s (longer than
    # in-flight's 1 s, so that is the reason given); 500 tokens of debt floor at -120: 61 s.
    assert decisions[0] == [
        None,
        None,
        ("tokens_per_minute", 5),
        None,
        None,
        None,
        ("requests_per_minute", 12),
        ("tokens_per_minute", 61),
    ]


async def test_a_bad_script_call_writes_nothing(redis_server):
    from slotserve.gateway.admission.quotas_redis import RedisQuotas

    store = RedisQuotas(redis_server.url, "bad")
    keys = ["bad:tenant:x:rpm", "bad:tenant:x:tpm", "bad:tenant:x:inflight"]
    for args in (
        ["r", "1", "5", "5", "1e3", "1000"],  # an exponent
        ["r", "1", "5", "5", "nan", "1000"],
        ["r", "1", "99999999999999999", "5", "1", "1000"],  # past the bounds
        ["", "1", "5", "5", "1", "1000"],  # no request id
    ):
        assert await store.scripts["take"](keys=keys, args=args) == ["invalid", 0]
    assert await store.client.keys("bad:*") == []
    await store.close()
