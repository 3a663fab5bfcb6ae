"""Engine tracing (slotserve/tracing.py, engine http/tracing.py): the engine app in process with an
injected tracer provider and an in-memory exporter; off without one; the CLI refuses an OTLP
endpoint it cannot serve."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from slotserve.engine import cli as engine_cli
from slotserve.engine.http.server import create_app
from slotserve.engine.settings import EngineSettings
from slotserve.tracing import TRACER, tracer_provider_from_env
from tests.spans import attributes, ended_at, in_memory_provider, started_at

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = "the secret launch code is"
MAX_TOKENS = 5


def completion(stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }


async def start_engine_app(model_dir, tracer_provider=None) -> TestClient:
    from slotserve.engine.core.async_engine import AsyncEngine

    settings = EngineSettings(
        model=str(model_dir), served_model_name="tiny", num_threads=1, max_batch_size=2
    )
    engine = await asyncio.to_thread(AsyncEngine.load, settings)
    client = TestClient(TestServer(create_app(engine, tracer_provider)))
    await client.start_server()
    async with asyncio.timeout(60):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
    return client


async def finished_spans(exporter: InMemorySpanExporter, server_name: str) -> list[ReadableSpan]:
    """Every span once the server span has ended (it ends just after the last byte is sent)."""
    async with asyncio.timeout(5):
        while not any(s.name == server_name for s in exporter.get_finished_spans()):
            await asyncio.sleep(0.01)
    return list(exporter.get_finished_spans())


async def read_answer(resp, stream: bool) -> dict:
    """The completion id and usage, from a whole answer or from the stream's events."""
    if not stream:
        body = await resp.json()
        return {"id": body["id"], "usage": body["usage"]}
    answer: dict = {}
    async for line in resp.content:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[len(b"data: ") :])
            answer["id"] = chunk["id"]
            if chunk.get("usage"):
                answer["usage"] = chunk["usage"]
    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_phases_continue_the_callers_trace_in_order(tiny_model_dir, stream):
    provider, exporter = in_memory_provider()
    client = await start_engine_app(tiny_model_dir, provider)
    try:
        resp = await client.post(
            "/v1/completions", json=completion(stream), headers={"traceparent": TRACEPARENT}
        )
        assert resp.status == 200
        answer = await read_answer(resp, stream)
        spans = await finished_spans(exporter, "POST /v1/completions")
    finally:
        await client.close()

    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v1/completions"
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and server.parent.is_remote
    assert f"{server.parent.span_id:016x}" == PARENT_ID
    assert attributes(server)["http.response.status_code"] == 200
    assert attributes(server)["gen_ai.request.model"] == "tiny"
    assert attributes(server)["gen_ai.response.id"] == answer["id"]
    assert attributes(server)["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attributes(server)["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attributes(server)["gen_ai.response.finish_reasons"] == ("length",)

    phases = sorted((s for s in spans if s is not server), key=started_at)
    assert [s.name for s in phases] == ["queued", "prefill", "decode"]
    queued, prefill, decode = phases
    for span in phases:
        assert span.context.trace_id == server.context.trace_id
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert attributes(span)["slotserve.request_id"] == answer["id"]
    # Back to back, inside the server span (arrival follows parsing and tokenizing).
    assert started_at(server) <= started_at(queued) <= ended_at(queued) == started_at(prefill)
    assert started_at(prefill) < ended_at(prefill) == started_at(decode) < ended_at(decode)
    assert ended_at(decode) <= ended_at(server)
    assert attributes(prefill)["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attributes(decode)["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attributes(decode)["slotserve.finish_reason"] == "length"
    # Wall-clock times: this request ran in the last minute.
    assert abs(ended_at(decode) - time.time_ns()) < 60e9

    # Never the prompt's text (nor any of it) in what is exported.
    values = [str(v) for s in spans for v in (s.attributes or {}).values()]
    assert not any("secret" in value or "launch" in value for value in values)


async def test_off_without_a_provider_and_the_answer_is_the_same(tiny_model_dir):
    assert tracer_provider_from_env("slotserve-engine", {}) is None
    body = {**completion(stream=False), "prompt": "a"}
    answers = {}
    for traced in (False, True):
        provider, _ = in_memory_provider() if traced else (None, None)
        client = await start_engine_app(tiny_model_dir, provider)
        try:
            assert (client.app[TRACER] is not None) is traced
            resp = await client.post(
                "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
            )
            assert resp.status == 200
            payload = await resp.json()
            answers[traced] = (
                sorted(resp.headers.keys() - {"Date", "Content-Length"}),
                payload["choices"],
                payload["usage"],
            )
        finally:
            await client.close()
    assert answers[False] == answers[True]
    # Nothing installed globally either way: the API still has its default, a no-op proxy.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_provider_from_the_environment(monkeypatch):
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    provider = tracer_provider_from_env("slotserve-engine", environ)
    assert isinstance(provider, TracerProvider)
    try:
        assert provider.resource.attributes["service.name"] == "slotserve-engine"
    finally:
        provider.shutdown()  # nothing was traced: nothing is sent


def test_cli_exits_2_when_an_endpoint_is_set_without_the_packages(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    # As if opentelemetry-exporter-otlp-proto-http were not installed.
    module = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    monkeypatch.setitem(sys.modules, module, None)
    assert engine_cli.main(["--model", "smollm2"]) == 2
    message = capsys.readouterr().err
    assert "OTEL_EXPORTER_OTLP_ENDPOINT is set" in message
    assert "pip install" in message
