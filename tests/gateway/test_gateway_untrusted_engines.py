"""Engines are untrusted input (issue 25, item 4): a /load report that is too long or holds values
no engine sends, a whole answer past the gateway's limit, an SSE event that never ends: the engine
is marked down (offered to nobody for a while), the request ends with the gateway's error (502, or
an SSE error event and no [DONE]), and the replica goes on serving. The stream is cut into events
in linear time."""

from __future__ import annotations

import json
import random
import time

import pytest
from aiohttp import web

from slotserve.gateway.http.proxy import EngineBrokeLimitsError, SseFramer
from tests.gateway.gateway_support import pool
from tests.support import free_port

GOOD_LOAD = {"model": "m", "slots_total": 2, "running": 0, "waiting": 0, "kv_cache_usage": 0.0}
ANSWER = {"id": "c", "object": "text_completion", "model": "m", "choices": [{"text": "hi"}]}


class RogueEngine:
    """An engine on a free port whose /load and answers the test sets."""

    def __init__(self) -> None:
        self.load_body: bytes = json.dumps(GOOD_LOAD).encode()
        self.answer: bytes = json.dumps(ANSWER).encode()
        self.stream: list[bytes] | None = None  # SSE chunks instead of the answer
        self.num_requests = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def load(self, _: web.Request) -> web.Response:
        return web.Response(body=self.load_body, content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        await request.read()
        if self.stream is None:
            return web.Response(body=self.answer, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in self.stream:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/load", self.load)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner


@pytest.fixture
async def rogue():
    engine = RogueEngine()
    runner = await engine.start()
    yield engine
    await runner.cleanup()


async def _complete(client, url: str, stream: bool = False):
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": stream}
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize(
    "load_body",
    [
        b'{"slots_total": 2, "padding": "' + b"x" * 70_000 + b'"}',
        b'{"slots_total": 2, "kv_cache_usage": NaN}',
        b'{"slots_total": 2, "kv_cache_usage": 1e999}',
        b'{"slots_total": 100000}',
        b'{"slots_total": -3}',
    ],
)
async def test_a_load_report_no_engine_sends_marks_it_down(gw, client, rogue, load_body):
    rogue.load_body = load_body
    url = await gw([pool("m", [rogue.url])], hold_at_zero=False, load_poll_interval_seconds=0.05)
    status, body = await _complete(client, url)
    assert status == 503 and b"no_ready_endpoint" in body
    assert rogue.num_requests == 0
    rogue.load_body = json.dumps(GOOD_LOAD).encode()  # sound again: still down for a while
    time.sleep(0.3)
    status, _ = await _complete(client, url)
    assert status == 503 and rogue.num_requests == 0


async def test_a_whole_answer_past_the_limit_is_502_and_marks_the_engine_down(gw, client, rogue):
    url = await gw([pool("m", [rogue.url])], max_upstream_answer_bytes=100_000, hold_at_zero=False)
    rogue.answer = json.dumps({**ANSWER, "padding": "x" * 200_000}).encode()
    status, body = await _complete(client, url)
    assert status == 502
    error = json.loads(body)["error"]
    assert error["code"] == "upstream_too_large" and rogue.url in error["message"]
    status, body = await _complete(client, url)  # the engine is offered to nobody now
    assert status == 503 and rogue.num_requests == 1


async def test_an_event_that_never_ends_ends_the_stream_with_an_error_event(gw, client, rogue):
    url = await gw([pool("m", [rogue.url])], hold_at_zero=False)
    first = b'data: {"choices": [{"text": "a"}]}\n\n'
    rogue.stream = [first, b"data: " + b"x" * (1 << 20), b"x" * 1000, b"\n\ndata: [DONE]\n\n"]
    status, body = await _complete(client, url, stream=True)
    assert status == 200
    assert body.startswith(first)  # the whole events before it went through
    events = body.strip().split(b"\n\n")
    last = json.loads(events[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_too_large" and b"[DONE]" not in body
    assert len(body) < 10_000  # no part of the runaway event reached the client
    status, _ = await _complete(client, url, stream=True)
    assert status == 503  # marked down


def test_sse_framing_is_linear_and_cuts_where_the_blank_lines_are():
    events = [f'data: {{"i": {i}, "text": "{"x" * (i % 50)}"}}\n\n'.encode() for i in range(3000)]
    stream = b"".join(events) + b"data: [DONE]\r\n\r\n"
    rng = random.Random(5)
    framer, out, i = SseFramer(), [], 0
    while i < len(stream):
        step = rng.choice([1, 2, 3, 16, 100, 4000])
        out.append(framer.feed(stream[i : i + step]))
        i += step
    assert b"".join(out) == stream and not framer.pending
    assert all(chunk.endswith((b"\n\n", b"\r\n\r\n")) for chunk in out if chunk)
    # 256 KiB of 16-byte chunks with no event end: rescanning all that is pending on every chunk
    # took 1.45 s of event loop; searched once, a few ms.
    framer = SseFramer()
    started = time.perf_counter()
    for _ in range(256 * 1024 // 16):
        framer.feed(b"x" * 16)
    assert time.perf_counter() - started < 0.2
    with pytest.raises(EngineBrokeLimitsError):
        for _ in range(800 * 1024 // 16):
            framer.feed(b"y" * 16)
