"""The gateway's part of a request's trace (see slotserve/tracing.py): an ``admission`` span for
the queue wait and one ``upstream`` span per attempt at an engine, whose context the engine
receives as ``traceparent`` (so its spans hang under the attempt that reached it). Both are
no-ops with tracing off."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from slotserve.gateway.admission.front import Lease
from slotserve.gateway.admission.types import AdmissionError
from slotserve.tracing import inject_trace_headers, request_span

Forward = Callable[[dict[str, str]], Awaitable[web.StreamResponse]]


async def traced_admission(request: web.Request, model: str, acquire: Awaitable[Lease]) -> Lease:
    """``await acquire`` inside an ``admission`` span: how long the request queued, where it
    went, or why it was refused."""
    traced = request_span(request)
    if traced is None:
        return await acquire
    tracer, span = traced
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("gen_ai.request.model", model)
    with tracer.start_as_current_span(
        "admission", context=trace.set_span_in_context(span), attributes={"slotserve.pool": model}
    ) as admission:
        try:
            lease = await acquire
        except AdmissionError as exc:
            admission.set_attribute("slotserve.admission.rejected", exc.code)
            admission.set_status(Status(StatusCode.ERROR, exc.code))
            raise
        admission.set_attributes(
            {
                "slotserve.admission.request_id": lease.request_id,
                "slotserve.queue_wait_ms": lease.queue_wait_s * 1000,
                "slotserve.endpoint": lease.endpoint,
            }
        )
        return lease


async def traced_upstream(
    request: web.Request, lease: Lease, headers: dict[str, str], forward: Forward
) -> web.StreamResponse:
    """``forward(headers)`` (one attempt at the lease's engine, streaming included) inside an
    ``upstream`` client span whose context goes to the engine as ``traceparent``."""
    traced = request_span(request)
    if traced is None:
        return await forward(headers)
    tracer, span = traced
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode

    with tracer.start_as_current_span(
        "upstream",
        context=trace.set_span_in_context(span),
        kind=SpanKind.CLIENT,
        attributes={
            "http.request.method": request.method,
            "url.full": f"{lease.endpoint}{request.path}",
            "slotserve.pool": lease.pool.name,
        },
    ) as upstream:
        traced_headers = dict(headers)
        inject_trace_headers(upstream, traced_headers)
        response = await forward(traced_headers)
        upstream.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            upstream.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
        return response
