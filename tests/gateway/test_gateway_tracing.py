"""Gateway tracing (slotserve/tracing.py, gateway tracing.py): the gateway app in process with an
injected tracer provider and an in-memory exporter, in front of an in-process engine double that
records the headers it receives, then in front of the real engine app (tiny model) tracing into
its own provider: one trace from client to decode. Off without a provider."""

from __future__ import annotations

import asyncio
import sys

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from slotserve.gateway import cli as gateway_cli
from slotserve.gateway.http.app import create_app
from slotserve.gateway.settings import GatewaySettings
from slotserve.tracing import TRACER
from tests.gateway.gateway_engine_double import create_double_app
from tests.gateway.gateway_support import pool, write_pools
from tests.spans import attributes, ended_at, in_memory_provider, started_at

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
SERVER_SPAN = "POST /v1/completions"
HEADERS_SEEN = web.AppKey("headers_seen", list)


async def start(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def start_double() -> TestClient:
    """The engine double, recording each completion request's headers."""
    app = create_double_app(slots=2, delay=0.01, model="m")
    app[HEADERS_SEEN] = []

    @web.middleware
    async def record(request: web.Request, handler):
        if request.path.startswith("/v1/"):
            request.app[HEADERS_SEEN].append(dict(request.headers))
        return await handler(request)

    app.middlewares.append(record)
    return await start(app)


async def start_gateway(tmp_path, model: str, engine_url: str, provider=None) -> TestClient:
    pools = write_pools(tmp_path / "pools.yaml", [pool(model, [engine_url])])
    settings = GatewaySettings(host="127.0.0.1", port=0, config=pools)
    client = await start(create_app(settings, provider))
    async with asyncio.timeout(30):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
    return client


def parent_span_id(span: ReadableSpan) -> int:
    assert span.parent is not None
    return span.parent.span_id


async def finished_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    async with asyncio.timeout(5):
        while not any(s.name == name for s in exporter.get_finished_spans()):
            await asyncio.sleep(0.01)
    return list(exporter.get_finished_spans())


def parse_traceparent(value: str) -> tuple[str, str]:
    version, trace_id, span_id, flags = value.split("-")
    assert version == "00" and flags == "01"
    return trace_id, span_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_admission_and_upstream_spans_and_the_traceparent_sent_on(tmp_path, stream):
    provider, exporter = in_memory_provider()
    engine = await start_double()
    gateway = await start_gateway(tmp_path, "m", str(engine.make_url("")).rstrip("/"), provider)
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream}
        resp = await gateway.post(
            "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
        )
        assert resp.status == 200
        text = await resp.text()
        assert ("data: [DONE]" in text) is stream
        spans = await finished_spans(exporter, SERVER_SPAN)
    finally:
        await gateway.close()
        await engine.close()

    (server,) = [s for s in spans if s.name == SERVER_SPAN]
    assert server.kind is SpanKind.SERVER
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert f"{parent_span_id(server):016x}" == CLIENT_SPAN_ID
    assert attributes(server)["gen_ai.request.model"] == "m"
    assert attributes(server)["http.response.status_code"] == 200
    (admission,) = [s for s in spans if s.name == "admission"]
    (upstream,) = [s for s in spans if s.name == "upstream"]
    for child in (admission, upstream):
        assert parent_span_id(child) == server.context.span_id
        assert child.context.trace_id == server.context.trace_id
    assert started_at(server) <= started_at(admission) <= ended_at(admission)
    assert ended_at(admission) <= started_at(upstream) <= ended_at(upstream) <= ended_at(server)
    assert attributes(admission)["slotserve.pool"] == "m"
    assert attributes(admission)["slotserve.queue_wait_ms"] >= 0
    assert upstream.kind is SpanKind.CLIENT
    assert attributes(upstream)["http.response.status_code"] == 200

    # The engine got the upstream span's context: same trace, parent = this attempt.
    (seen,) = engine.app[HEADERS_SEEN]
    trace_id, parent_id = parse_traceparent(seen["traceparent"])
    assert trace_id == TRACE_ID
    assert parent_id == f"{upstream.context.span_id:016x}"


async def test_a_refused_request_has_a_failed_admission_span(tmp_path):
    provider, exporter = in_memory_provider()
    engine = await start_double()
    pools = write_pools(
        tmp_path / "pools.yaml",
        [pool("m", [str(engine.make_url("")).rstrip("/")], queueTimeoutSeconds=0.2)],
    )
    settings = GatewaySettings(host="127.0.0.1", port=0, config=pools)
    gateway = await start(create_app(settings, provider))
    try:
        async with asyncio.timeout(30):
            while (await gateway.get("/ready")).status != 200:
                await asyncio.sleep(0.05)
        # Both slots held by slow requests; the third waits out its queue timeout.
        slow = {"model": "m", "prompt": "slow", "max_tokens": 1, "x_delay": 2}
        holders = [asyncio.create_task(gateway.post("/v1/completions", json=slow)) for _ in "ab"]
        await asyncio.sleep(0.3)
        resp = await gateway.post("/v1/completions", json={"model": "m", "prompt": "late"})
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "queue_timeout"
        for response in await asyncio.gather(*holders):
            assert response.status == 200
        spans = await finished_spans(exporter, SERVER_SPAN)
    finally:
        await gateway.close()
        await engine.close()
    refused = [
        s for s in spans if s.name == "admission" and s.status.status_code is StatusCode.ERROR
    ]
    assert len(refused) == 1
    assert attributes(refused[0])["slotserve.admission.rejected"] == "queue_timeout"
    (server,) = [
        s
        for s in spans
        if s.name == SERVER_SPAN and s.context.span_id == parent_span_id(refused[0])
    ]
    assert attributes(server)["http.response.status_code"] == 503
    assert server.status.status_code is StatusCode.ERROR
    assert not [
        s for s in spans if s.name == "upstream" and parent_span_id(s) == server.context.span_id
    ]


async def test_one_trace_from_the_client_through_the_gateway_to_the_engine(
    tmp_path, tiny_model_dir
):
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.http.server import create_app as create_engine_app
    from slotserve.engine.settings import EngineSettings

    gateway_provider, gateway_spans = in_memory_provider()
    engine_provider, engine_spans = in_memory_provider()
    settings = EngineSettings(model=str(tiny_model_dir), served_model_name="tiny", num_threads=1)
    loaded = await asyncio.to_thread(AsyncEngine.load, settings)
    engine = await start(create_engine_app(loaded, engine_provider))
    try:
        gateway = await start_gateway(
            tmp_path, "tiny", str(engine.make_url("")).rstrip("/"), gateway_provider
        )
        try:
            body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "ignore_eos": True}
            resp = await gateway.post(
                "/v1/completions", json=body, headers={"traceparent": TRACEPARENT}
            )
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            gateway_side = await finished_spans(gateway_spans, SERVER_SPAN)
            engine_side = await finished_spans(engine_spans, SERVER_SPAN)
        finally:
            await gateway.close()
    finally:
        await engine.close()

    assert {f"{s.context.trace_id:032x}" for s in gateway_side + engine_side} == {TRACE_ID}
    (upstream,) = [s for s in gateway_side if s.name == "upstream"]
    (engine_server,) = [s for s in engine_side if s.name == SERVER_SPAN]
    assert parent_span_id(engine_server) == upstream.context.span_id
    phases = sorted((s for s in engine_side if s is not engine_server), key=started_at)
    assert [s.name for s in phases] == ["queued", "prefill", "decode"]
    assert attributes(phases[2])["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    # The engine's work happened inside the gateway's upstream call.
    assert started_at(upstream) <= started_at(phases[0])
    assert ended_at(phases[2]) <= ended_at(upstream)


async def test_off_without_a_provider_the_answer_is_the_same(tmp_path):
    answers = {}
    for traced in (False, True):
        provider, _ = in_memory_provider() if traced else (None, None)
        engine = await start_double()
        gateway = await start_gateway(tmp_path, "m", str(engine.make_url("")).rstrip("/"), provider)
        try:
            assert (gateway.app[TRACER] is not None) is traced
            resp = await gateway.post(
                "/v1/completions",
                json={"model": "m", "prompt": "hi", "max_tokens": 2},
                headers={"traceparent": TRACEPARENT},
            )
            assert resp.status == 200
            body = await resp.json()
            body.pop("created")
            answers[traced] = (sorted(resp.headers.keys() - {"Date"}), body)
            (seen,) = engine.app[HEADERS_SEEN]
        finally:
            await gateway.close()
            await engine.close()
        if not traced:
            # Not taking part, the gateway drops the client's context: a client does not choose
            # the trace (or the sampling) of engines every tenant shares.
            assert "traceparent" not in seen
    assert answers[False] == answers[True]


def test_cli_exits_2_when_an_endpoint_is_set_without_the_packages(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    pools = write_pools(tmp_path / "pools.yaml", [pool("m", ["http://127.0.0.1:1"])])
    assert gateway_cli.main(["--config", str(pools), "--port", "0"]) == 2
    message = capsys.readouterr().err
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set" in message
    assert "pip install" in message
