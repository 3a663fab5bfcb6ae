"""Start-up and shutdown of a real engine process: probes while loading, SIGTERM drain, exit 0."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.engine.engine_server_support import EngineProcess, completion_body, json_event


async def read_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    """Every SSE data payload of a stream: parsed JSON, or the string "[DONE]"."""
    events: list[dict | str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def stream_body(max_tokens: int) -> dict:
    return {
        **completion_body(max_tokens, stream=True),
        "stream_options": {"include_usage": True},
    }


async def status_of(session, method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with session.request(method, url, **kwargs) as resp:
        return resp.status, dict(resp.headers)


async def test_health_during_load_then_sigterm_drains_in_flight_stream(tiny_model_dir, tmp_path):
    engine = EngineProcess(
        tiny_model_dir, tmp_path / "engine.log", "--drain-timeout-seconds", "60",
    )  # fmt: skip
    engine.start(wait_ready=False)
    try:
        # /health answers while the model is still loading; /ready does not.
        seen_loading = False
        for _ in range(1200):
            assert engine.proc is not None and engine.proc.poll() is None, engine.logs()
            health, ready = engine.status("/health"), engine.status("/ready")
            if health == 200 and ready == 503:
                seen_loading = True
            if ready == 200:
                break
            await asyncio.sleep(0.05)
        assert seen_loading, engine.logs()
        engine.wait_ready(timeout=60)

        # Long enough to outlast the checks below at any speed: 1,000 tokens of the tiny model
        # stream in ~0.8 s with native decode steps (the model allows 2,048 positions).
        num_tokens = 2000
        async with aiohttp.ClientSession() as session:
            resp = await session.post(engine.url + "/v1/completions", json=stream_body(num_tokens))
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            engine.terminate()  # SIGTERM while the stream runs
            rest = asyncio.create_task(read_events(resp))

            await asyncio.sleep(0.3)
            status, _ = await status_of(session, "GET", engine.url + "/ready")
            assert status == 503
            status, headers = await status_of(
                session, "POST", engine.url + "/v1/completions",
                json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            )  # fmt: skip
            assert status == 503
            assert "Retry-After" in headers
            load = await (await session.get(engine.url + "/load")).json()
            assert load["draining"] is True
            assert not rest.done(), "the drain must not cut the running stream"

            events = await asyncio.wait_for(rest, timeout=60)
        assert events[-1] == "[DONE]"
        assert json_event(events[-2])["usage"]["completion_tokens"] == num_tokens
        assert json_event(events[-3])["choices"][0]["finish_reason"] == "length"
        assert engine.wait_exit(timeout=20) == 0
    finally:
        engine.stop()


async def test_drain_timeout_aborts_what_is_still_running(tiny_model_dir, tmp_path):
    # 0.2 s: with native decode steps the tiny model streams 2,000 tokens in about a second.
    engine = EngineProcess(
        tiny_model_dir, tmp_path / "engine.log", "--drain-timeout-seconds", "0.2",
    )  # fmt: skip
    engine.start()
    try:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(engine.url + "/v1/completions", json=stream_body(2000))
            assert (await resp.content.readline()).startswith(b"data: ")
            engine.terminate()
            events = await asyncio.wait_for(read_events(resp), timeout=15)
        # The client learns that its answer was cut, instead of a silently short text: an
        # error event ends the stream, and no [DONE] follows it.
        assert json_event(events[-1])["error"]["code"] == "aborted"
        assert "[DONE]" not in events
        assert engine.wait_exit(timeout=15) == 0
    finally:
        engine.stop()


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    engine = EngineProcess(tmp_path / "no-such-model", tmp_path / "engine.log")
    engine.start(wait_ready=False)
    try:
        assert engine.wait_exit(timeout=60) == 1
    finally:
        engine.stop()
