"""Streams end truthfully: an engine failure after the first byte ends the client's stream with an
OpenAI-shaped error event and no [DONE]; the upstream timeout bounds silence, not length; a
non-streaming failure is an error status with OpenAI's body."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest

from tests.gateway.gateway_support import pool
from tests.gateway.test_gateway_http import completion


def events_of(text: str) -> list[str]:
    """The data of each SSE event; every one must be whole (no half event before an error)."""
    events = [event for event in text.split("\n\n") if event.strip()]
    data = []
    for event in events:
        assert event.startswith("data: "), event
        payload = event.removeprefix("data: ")
        if payload != "[DONE]":
            json.loads(payload)  # raises on a truncated event
        data.append(payload)
    return data


async def stream_text(client, url: str, body: dict) -> tuple[int, str, float]:
    started = time.monotonic()
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        text = (await resp.read()).decode()
        return resp.status, text, time.monotonic() - started


async def wait_for_aborts(engine, count: int, bound_s: float = 5) -> None:
    deadline = time.monotonic() + bound_s
    while engine.stats()["num_aborted"] < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.stats()["num_aborted"] == count


@pytest.mark.parametrize(
    ("fail", "code"),
    [
        ("error_event", "engine_failed"),  # the engine's own event, passed through
        ("drop", "upstream_failed"),
        ("partial", "upstream_failed"),
        ("eof", "upstream_incomplete"),
    ],
)
async def test_stream_failing_mid_way_ends_with_an_error_event_not_done(
    gw, spawn, client, fail, code
):
    engine = spawn.double(slots=1, delay=0.2)
    url = await gw([pool("m", [engine.url])])
    body = completion(stream=True, max_tokens=6, x_fail=fail, x_fail_after=2)
    status, text, _ = await stream_text(client, url, body)
    assert status == 200  # sent before the failure: the stream itself must say it failed
    events = events_of(text)
    assert "[DONE]" not in events
    assert len(events) == 3
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0 ", "t1 "]
    error = json.loads(events[-1])["error"]
    assert error["code"] == code and error["message"]
    # The slot came back: the next request on the 1-slot engine is served at once.
    status, text, took = await stream_text(client, url, completion(stream=True, x_delay=0))
    assert status == 200 and events_of(text)[-1] == "[DONE]"
    assert took < 2


async def test_openai_client_sees_the_mid_stream_failure(gw, spawn):
    engine = spawn.double(slots=1, delay=0.2)
    url = await gw([pool("m", [engine.url])])
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=20) as oai:
        received = []
        stream = await oai.completions.create(
            model="m",
            prompt="hi",
            max_tokens=6,
            stream=True,
            extra_body={"x_fail": "error_event"},
        )
        with pytest.raises(openai.APIError, match="NaN in logits"):
            async for chunk in stream:
                received.append(chunk.choices[0].text)
        assert received == ["t0 ", "t1 "]


async def test_upstream_timeout_bounds_silence_not_length(gw, spawn, client):
    engine = spawn.double(slots=1, delay=0.0)
    url = await gw([pool("m", [engine.url])], upstream_read_timeout_seconds=1.0)
    # 8 chunks 0.4 s apart: 3.2 s in all, three times the read timeout, and never cut.
    status, text, took = await stream_text(
        client, url, completion(stream=True, max_tokens=8, x_delay=3.2)
    )
    assert status == 200
    assert events_of(text)[-1] == "[DONE]" and len(events_of(text)) == 9
    assert took > 3.0
    # Silent for 5 s after two chunks: the client hears of it after ~1 s, not after 5 s.
    body = completion(stream=True, max_tokens=6, x_delay=0, x_fail="stall", x_stall=5)
    status, text, took = await stream_text(client, url, body)
    events = events_of(text)
    assert status == 200 and "[DONE]" not in events and len(events) == 3
    error = json.loads(events[-1])["error"]
    assert error["code"] == "upstream_timeout" and "sent nothing for 1 s" in error["message"]
    assert 0.9 < took < 2.5
    await wait_for_aborts(engine, 1)  # the engine was told to stop (connection closed)


@pytest.mark.parametrize(
    ("fail", "status", "code"),
    [("drop", 502, "upstream_failed"), ("stall", 504, "upstream_timeout")],
)
async def test_non_streaming_failure_is_an_openai_error_status(
    gw, spawn, client, fail, status, code
):
    engine = spawn.double(slots=1, delay=0.05)
    url = await gw([pool("m", [engine.url])], upstream_read_timeout_seconds=1.0)
    started = time.monotonic()
    body = completion(x_fail=fail, x_stall=5)
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["code"] == code and error["type"] == "upstream_error"
    assert time.monotonic() - started < 3
    assert engine.stats()["num_requests"] == 1  # not retried after the engine took it
    async with client.post(f"{url}/v1/completions", json=completion()) as resp:
        assert resp.status == 200


async def test_engine_error_status_passes_through(gw, spawn, client):
    engine = spawn.double(slots=1)
    url = await gw([pool("m", [engine.url])])
    async with client.post(f"{url}/v1/completions", json=completion(x_fail="error_500")) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "NaN in logits"
