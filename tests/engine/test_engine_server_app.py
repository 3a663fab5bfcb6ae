"""`create_app` in process: a failed load seen on every probe, and a preloaded engine."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from slotserve.engine.http.server import STATE, create_app
from slotserve.engine.settings import EngineSettings


async def failed_app_client(tmp_path) -> TestClient:
    app = create_app(EngineSettings(model=str(tmp_path / "no-such-model"), port=0))
    client = TestClient(TestServer(app))
    await client.start_server()
    state = app[STATE]
    await state.fatal.wait()  # the load fails at once: there is no such folder
    return client


async def test_failed_load_is_visible_on_every_probe(tmp_path):
    client = await failed_app_client(tmp_path)
    try:
        resp = await client.get("/health")
        assert resp.status == 503
        assert "failed to load" in (await resp.json())["error"]["message"]
        resp = await client.get("/ready")
        assert resp.status == 503
        resp = await client.get("/load")
        assert resp.status == 503
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status == 503
        assert resp.headers["Retry-After"]
        body = await resp.json()
        assert body["error"]["code"] == "loading"
        metrics = await (await client.get("/metrics")).text()
        assert "slotserve_draining 0.0" in metrics
        assert 'slotserve_requests_rejected_total{reason="loading"} 1.0' in metrics
    finally:
        await client.close()


async def test_unknown_paths_answer_openai_errors(tmp_path):
    client = await failed_app_client(tmp_path)
    try:
        resp = await client.get("/v1/nothing")
        assert resp.status == 404
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
        resp = await client.put("/v1/chat/completions")
        assert resp.status == 405
    finally:
        await client.close()


async def test_app_serves_a_preloaded_engine_and_shuts_it_down(tiny_model_dir):
    from slotserve.engine.core.async_engine import AsyncEngine

    settings = EngineSettings(model=str(tiny_model_dir), served_model_name="tiny", num_threads=1)
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    app = create_app(engine)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        await asyncio.wait_for(wait_ready(client), timeout=30)
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        body = await resp.json()
        assert resp.status == 200, body
        assert body["usage"]["completion_tokens"] <= 3
        assert body["choices"][0]["message"]["role"] == "assistant"
    finally:
        await client.close()
    # Closing the app shut the engine down: it takes no more requests.
    assert not engine.is_running


async def wait_ready(client: TestClient) -> None:
    while (await client.get("/ready")).status != 200:
        await asyncio.sleep(0.05)
