"""One gateway (in-process admission, run in the test's event loop, fixtures ``gw`` and
``client`` in conftest.py) in front of engine doubles."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.gateway.gateway_support import pool, write_pools
from tests.support import free_port


def completion(model: str = "m", prompt: str = "hi", **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, **extra}


async def test_completion_chat_and_models_pass_through(gw, spawn, client):
    engine = spawn.double(slots=2, delay=0.01)
    url = await gw([pool("m", [engine.url])])
    async with client.post(f"{url}/v1/completions", json=completion()) as resp:
        assert resp.status == 200
        body = await resp.json()
        assert body["choices"][0]["text"].startswith("ok")
        assert resp.headers["x-slotserve-slots-total"] == "2"
        assert float(resp.headers["x-slotserve-queue-wait-ms"]) >= 0
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    async with client.post(f"{url}/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["role"] == "assistant"
    async with client.get(f"{url}/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
    assert engine.stats()["arrivals"] == ["hi", "hello"]


async def test_streaming_is_not_buffered(gw, spawn, client):
    engine = spawn.double(slots=2, delay=1.2)
    url = await gw([pool("m", [engine.url])])
    started = time.monotonic()
    arrivals = []
    async with client.post(f"{url}/v1/completions", json=completion(stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data:"):
                arrivals.append((time.monotonic() - started, line.strip()))
    assert arrivals[-1][1] == b"data: [DONE]"
    assert len(arrivals) == 5
    assert arrivals[0][0] < 0.8  # first token long before the whole answer (1.2 s)
    assert arrivals[-1][0] > 1.0


async def test_unknown_model_is_404_in_openai_shape(gw, spawn, client):
    engine = spawn.double()
    url = await gw([pool("m", [engine.url])])
    async with client.post(f"{url}/v1/completions", json=completion(model="nope")) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert "nope" in error["message"] and error["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("data", "headers", "status", "needle"),
    [
        (b"{not json", {}, 400, "not valid JSON"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (b'{"prompt": "x"}', {}, 400, "'model'"),
        (json.dumps(completion()).encode(), {"x-slotserve-priority": "high"}, 400, "integer"),
        (json.dumps(completion()).encode(), {"x-slotserve-priority": "0"}, 400, "between 1"),
        (json.dumps(completion()).encode(), {"x-slotserve-deadline-ms": "-5"}, 400, "between"),
        (b"\xff\xfe\x00garbage", {}, 400, "not valid JSON"),
        (b'{"model": "m", "prompt": "' + b"x" * 2_000_000 + b'"}', {}, 413, "too large"),
    ],
)
async def test_bad_input_is_4xx_with_a_message(gw, spawn, client, data, headers, status, needle):
    engine = spawn.double()
    url = await gw([pool("m", [engine.url])])
    headers = {"Content-Type": "application/json", **headers}
    async with client.post(f"{url}/v1/completions", data=data, headers=headers) as resp:
        assert resp.status == status
        assert needle in (await resp.json())["error"]["message"]
    assert engine.stats()["num_requests"] == 0


async def test_api_keys(gw, spawn, client, tmp_path):
    engine = spawn.double()
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsecret-one\nsecret-two\n")
    url = await gw([pool("m", [engine.url])], api_keys_file=keys)
    for auth in (None, "Bearer wrong", "Basic secret-one", "secret-one"):
        headers = {"Authorization": auth} if auth else {}
        async with client.post(f"{url}/v1/completions", json=completion(), headers=headers) as r:
            assert r.status == 401
            assert (await r.json())["error"]["type"] == "authentication_error"
    granted = {"Authorization": "Bearer secret-two"}
    async with client.post(f"{url}/v1/completions", json=completion(), headers=granted) as resp:
        assert resp.status == 200
    async with client.get(f"{url}/health") as resp:
        assert resp.status == 200


async def test_engine_failing_before_first_byte_is_retried_elsewhere(gw, spawn, client):
    bad, good = spawn.double(), spawn.double()
    bad.control(fail="503")
    url = await gw([pool("m", [bad.url, good.url])])
    for _ in range(4):
        async with client.post(f"{url}/v1/completions", json=completion()) as resp:
            assert resp.status == 200
    assert good.stats()["num_requests"] == 4


async def test_client_disconnect_aborts_upstream_and_frees_the_slot(gw, spawn, client):
    engine = spawn.double(slots=1, delay=5.0)
    url = await gw([pool("m", [engine.url])])
    resp = await client.post(f"{url}/v1/completions", json=completion(stream=True, max_tokens=50))
    await resp.content.readline()  # first chunk is flowing
    resp.close()
    deadline = time.monotonic() + 5
    while engine.stats()["num_aborted"] < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.stats()["num_aborted"] == 1
    started = time.monotonic()
    async with client.post(f"{url}/v1/completions", json=completion(x_delay=0)) as resp:
        assert resp.status == 200
    assert time.monotonic() - started < 2


async def test_queue_full_429_and_deadline_503_with_retry_after(gw, spawn, client):
    engine = spawn.double(slots=1, delay=1.5)
    url = await gw([pool("m", [engine.url], maxQueueSize=1, queueTimeoutSeconds=30)])
    busy = asyncio.create_task(client.post(f"{url}/v1/completions", json=completion()))
    await asyncio.sleep(0.3)
    queued = asyncio.create_task(client.post(f"{url}/v1/completions", json=completion()))
    await asyncio.sleep(0.3)
    async with client.post(f"{url}/v1/completions", json=completion()) as resp:
        assert resp.status == 429
        assert int(resp.headers["Retry-After"]) >= 1
        assert "queue" in (await resp.json())["error"]["message"]
    for task in (busy, queued):
        resp = await task
        assert resp.status == 200
        resp.release()
    slow = asyncio.create_task(client.post(f"{url}/v1/completions", json=completion()))
    await asyncio.sleep(0.3)
    started = time.monotonic()
    headers = {"x-slotserve-deadline-ms": "300"}
    async with client.post(f"{url}/v1/completions", json=completion(), headers=headers) as r:
        assert r.status == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert "queue timeout" in (await r.json())["error"]["message"]
    assert 0.25 < time.monotonic() - started < 1.2
    (await slow).release()


async def test_metrics_and_pool_file_reload(gw, spawn, client, tmp_path):
    engine = spawn.double()
    url = await gw([pool("m", [engine.url])])
    async with client.post(f"{url}/v1/completions", json=completion()) as resp:
        assert resp.status == 200
    async with client.get(f"{url}/metrics") as resp:
        text = await resp.text()
    assert 'slotserve_gateway_admitted_total{pool="m"} 1.0' in text
    assert "slotserve_gateway_queue_wait_seconds_bucket" in text
    assert 'slotserve_gateway_queue_size{pool="m"}' in text
    pool_file = next(tmp_path.glob("pools-*.yaml"))
    await asyncio.sleep(0.01)
    write_pools(pool_file, [pool("m", [engine.url]), pool("m2", [engine.url])])
    deadline = time.monotonic() + 5
    status = 404
    while status == 404 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        async with client.post(f"{url}/v1/completions", json=completion(model="m2")) as resp:
            status = resp.status
    assert status == 200


async def test_pool_without_ready_engine_is_503_at_once(gw, client):
    # Holding off (on, the request would wait for an engine: test_gateway_scale_from_zero.py).
    url = await gw([pool("m", [f"http://127.0.0.1:{free_port()}"])], hold_at_zero=False)
    started = time.monotonic()
    async with client.post(f"{url}/v1/completions", json=completion()) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert "no engine" in (await resp.json())["error"]["message"]
    assert time.monotonic() - started < 1


async def test_oversized_header_is_rejected_and_api_keys_never_logged(
    gw, spawn, client, tmp_path, caplog
):
    engine = spawn.double()
    keys = tmp_path / "keys"
    keys.write_text("top-secret-key\n")
    url = await gw([pool("m", [engine.url])], api_keys_file=keys)
    caplog.set_level("DEBUG")
    headers = {"Authorization": "Bearer top-secret-key", "x-filler": "y" * 20_000}
    async with client.post(f"{url}/v1/completions", json=completion(), headers=headers) as resp:
        assert 400 <= resp.status < 500
        assert (await resp.text()).strip()
    for auth, expected in (("Bearer top-secret-key", 200), ("Bearer top-secret-kez", 401)):
        headers = {"Authorization": auth}
        async with client.post(f"{url}/v1/completions", json=completion(), headers=headers) as r:
            assert r.status == expected
    assert "top-secret-ke" not in caplog.text
