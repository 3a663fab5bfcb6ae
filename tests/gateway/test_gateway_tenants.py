"""Tenants: declared in the keys file, bounded at load, and their quotas on the in-process
backend (one gateway in this process, a real engine double over HTTP)."""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
import pytest

from slotserve.gateway.admission.quotas import InProcessQuotas
from slotserve.gateway.admission.tenants import MAX_PER_MINUTE, Tenant
from slotserve.gateway.http.api_keys import ApiKeys, ApiKeysError, parse_keys_file
from tests.gateway.gateway_support import pool

KEYS = """\
# team a: two keys, limits stated once
sk-a1 tenant=team-a weight=3 rpm=2
sk-a2 tenant=team-a levels=1-9
sk-b  tenant=team-b max-inflight=1
sk-z  tenant=zero rpm=0
sk-t  tenant=tok tpm=100
sk-t2 tenant=tok2 tpm=100
sk-old
"""


def test_keys_file_declares_tenants_backward_compatibly():
    keys, tenants = parse_keys_file(KEYS, "keys")
    assert [(k.tenant, k.levels) for k in keys][:2] == [("team-a", range(1, 10))] * 2
    assert tenants["team-a"] == Tenant("team-a", weight=3, requests_per_minute=2)
    assert tenants["team-b"].max_inflight == 1 and tenants["team-b"].weight == 1
    assert tenants["zero"].has_zero_quota
    assert keys[-1].tenant == "default" and not tenants["default"].limited
    # The old format (a bare key, levels=) reads as before.
    old, _ = parse_keys_file("sk-1\nsk-2 levels=5-9\n", "keys")
    assert [k.levels for k in old] == [range(1, 10), range(5, 10)]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("sk-x tenant=" + "a" * 64, "tenant= must be 1-63"),
        ("sk-x tenant=bad/name", "tenant= must be"),
        ("sk-x tenant=-lead", "tenant= must be"),
        ("sk-x tenant=a rpm=" + str(MAX_PER_MINUTE + 1), "rpm= must be an integer from 0"),
        ("sk-x rpm=1e3", "rpm= must be an integer"),
        ("sk-x tpm=\u0663", "tpm= must be an integer"),  # an Arabic-Indic digit: int() takes it
        ("sk-x weight=0", "weight= must be an integer from 1 to 1000"),
        ("sk-x max-inflight=-1", "max-inflight= must be"),
        ("sk-x tenant=a rpm=5\nsk-y tenant=a rpm=6", "line 3: tenant 'a' has rpm=5"),
        ("sk-x colour=red", "unknown option"),
    ],
)
def test_bad_tenant_entries_are_refused_naming_the_line(line, needle):
    with pytest.raises(ApiKeysError) as caught:
        parse_keys_file("sk-ok\n" + line, "keys.txt")
    message = str(caught.value)
    assert needle in message and "keys.txt line" in message
    assert "sk-x" not in message and "sk-y" not in message  # never the key


def test_bad_tenant_update_keeps_the_old_keys_and_says_which_line(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text("sk-a tenant=team-a rpm=5\n")
    keys = ApiKeys(path)
    path.write_text("sk-a tenant=team-a rpm=5\n\nsk-b tenant=team-b rpm=lots\n")
    os.utime(path, ns=(1, 1))  # a new identity even within the same mtime tick
    with caplog.at_level(logging.ERROR):
        assert not keys.reload_if_changed()
    assert "line 3" in caplog.text and "keeping the previous API keys" in caplog.text
    assert keys.tenant_of("Bearer sk-a").requests_per_minute == 5
    assert not keys.accepts("Bearer sk-b")


async def test_in_process_buckets_refill_exactly_and_zero_refuses():
    quotas = InProcessQuotas()
    tenant = Tenant("t", requests_per_minute=2, tokens_per_minute=600)
    assert await quotas.take(tenant, "r1", 100) is None
    assert await quotas.take(tenant, "r2", 100) is None
    refusal = await quotas.take(tenant, "r3", 1)
    # 2 per minute: one request refills in 30 s.
    assert refusal is not None and refusal.reason == "requests_per_minute"
    assert refusal.retry_after_s is not None and 29 <= refusal.retry_after_s <= 30
    zero = await quotas.take(Tenant("z", tokens_per_minute=0), "r", 1)
    assert zero is not None and zero.reason == "zero_quota" and zero.retry_after_s is None
    tokens = Tenant("tok", tokens_per_minute=600)  # 10 tokens per second
    assert await quotas.take(tokens, "a", 600) is None  # the whole minute at once
    short = await quotas.take(tokens, "b", 50)
    assert short is not None and short.reason == "tokens_per_minute"
    assert short.retry_after_s is not None and 5 <= short.retry_after_s <= 6  # 50 tokens at 10/s
    await quotas.charge(tokens, -600)  # the answer used nothing: given back
    assert await quotas.take(tokens, "c", 50) is None


# -- over HTTP, one gateway (in-process backend) ------------------------------------------------


def body(**extra) -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 3, **extra}


async def post(client: aiohttp.ClientSession, url: str, key: str, **extra):
    headers = {"Authorization": f"Bearer {key}"}
    async with client.post(f"{url}/v1/completions", json=body(**extra), headers=headers) as r:
        return r.status, r.headers.get("Retry-After"), await r.json()


async def post_stream(client: aiohttp.ClientSession, url: str, key: str, **extra) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    payload = body(stream=True, **extra)
    async with client.post(f"{url}/v1/completions", json=payload, headers=headers) as r:
        await r.read()
        return r.status


async def tenant_gateway(gw, spawn, tmp_path, delay: float = 0.02) -> str:
    engine = spawn.double(slots=16, delay=delay)
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    return await gw([pool("m", [engine.url])], api_keys_file=keys)


async def test_rpm_refuses_with_the_refill_s_retry_after(gw, spawn, client, tmp_path):
    url = await tenant_gateway(gw, spawn, tmp_path)
    results = [await post(client, url, key) for key in ("sk-a1", "sk-a2", "sk-a1")]
    assert [status for status, *_ in results] == [200, 200, 429]
    _, retry_after, answer = results[2]
    assert answer["error"]["code"] == "requests_per_minute"
    assert retry_after is not None and 29 <= int(retry_after) <= 30
    assert (await post(client, url, "sk-old"))[0] == 200  # other tenants are not touched
    async with client.get(f"{url}/metrics") as resp:
        text = await resp.text()
    assert 'slotserve_gateway_tenant_requests_total{outcome="answered",tenant="team-a"} 2.0' in text
    assert (
        'slotserve_gateway_tenant_requests_total{outcome="requests_per_minute",tenant="team-a"} 1.0'
        in text
    )


async def test_quota_of_zero_refuses_at_once_without_retry_after(gw, spawn, client, tmp_path):
    url = await tenant_gateway(gw, spawn, tmp_path)
    status, retry_after, answer = await post(client, url, "sk-z")
    assert (status, retry_after, answer["error"]["code"]) == (429, None, "insufficient_quota")


async def test_tokens_are_corrected_by_the_answer_s_usage(gw, spawn, client, tmp_path):
    # tpm=100; the estimate is body/4 + max_tokens (~23 + 3), the double's usage says 1 + 3:
    # corrected down, so many more than 100 / 26 requests pass within the minute.
    url = await tenant_gateway(gw, spawn, tmp_path)
    statuses = [(await post(client, url, "sk-t"))[0] for _ in range(8)]
    assert statuses == [200] * 8
    # A request estimated above the minute's tokens passes on a full bucket (else it never
    # could); streamed, it keeps its estimate (~513 tokens): the bucket is in debt (at most a
    # minute's worth), so the tenant's next request waits more than a minute.
    big = await post_stream(client, url, "sk-t2", max_tokens=500)
    assert big == 200
    again = await post(client, url, "sk-t2")
    assert again[0] == 429 and again[2]["error"]["code"] == "tokens_per_minute"
    assert 60 < int(again[1]) <= 120


async def test_max_inflight_is_released_exactly_disconnects_included(gw, spawn, client, tmp_path):
    url = await tenant_gateway(gw, spawn, tmp_path, delay=0.6)
    first = asyncio.create_task(post(client, url, "sk-b"))
    await asyncio.sleep(0.2)
    status, retry_after, answer = await post(client, url, "sk-b")
    assert (status, retry_after, answer["error"]["code"]) == (429, "1", "max_inflight")
    assert (await first)[0] == 200
    assert (await post(client, url, "sk-b"))[0] == 200  # released when its answer ended
    # A client that goes away mid-request (its answer would take 20 s) gives its place back at
    # once, not when the answer would have ended nor after the place's TTL (10 s).
    timeout = aiohttp.ClientTimeout(total=0.3)
    with pytest.raises(asyncio.TimeoutError):
        await client.post(
            f"{url}/v1/completions",
            json=body(x_delay=20),
            headers={"Authorization": "Bearer sk-b"},
            timeout=timeout,
        )
    for _ in range(40):  # bounded (2 s): the release is a task of its own
        status, *_ = await post(client, url, "sk-b")
        if status == 200:
            break
        await asyncio.sleep(0.05)
    assert status == 200


def test_estimates_and_outcome_labels_are_bounded():
    from aiohttp import web

    from slotserve.gateway.http.tenant_gate import estimate_tokens, outcome_of

    body = b"x" * 400
    assert estimate_tokens(body, None) == 100
    assert estimate_tokens(body, {"max_tokens": 50, "n": 2}) == 200
    assert estimate_tokens(body, {"max_completion_tokens": 7, "max_tokens": 50}) == 107
    assert estimate_tokens(body, {"max_tokens": "lots", "n": True}) == 100
    queue_full = web.json_response({"error": {"code": "queue_full"}}, status=429)
    assert outcome_of(queue_full) == "queue_full"
    # An engine's own code (engines are untrusted) never becomes a label value.
    engine_code = web.json_response({"error": {"code": "made_up_by_an_engine"}}, status=400)
    assert outcome_of(engine_code) == "http_400"
    assert outcome_of(web.json_response({"ok": 1})) == "answered"
