"""The app without a loaded model: probes, 503s and error shapes (aiohttp test server, no torch)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer
from slotserve.engine.server import STATE, create_app
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
