"""Optional OpenTelemetry tracing for the engine and the gateway: off unless an OTLP endpoint is
set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).

One trace per request. The gateway's server span continues the client's W3C ``traceparent`` (if
any) and holds an ``admission`` span (the queue wait) and one ``upstream`` span per attempt,
whose context travels to the engine as ``traceparent``. The engine's server span continues that
and holds ``queued``, ``prefill`` and ``decode`` spans built from the engine's own timestamps
when the request ends (slotserve/engine/http/tracing.py), so the step loop never touches tracing.

Each command builds its tracer provider once at start-up (``tracer_provider_from_env``) and hands
it to ``create_app``; tests hand in their own, with an in-memory exporter. Nothing is installed
globally. Off, nothing imports OpenTelemetry and no middleware is added: a request pays one dict
lookup per hook.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Middleware

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
TRACE_HEADERS = ("traceparent", "tracestate")
INSTALL_HINT = "pip install 'slotserve[engine]' or 'slotserve[gateway]'"

# The app's tracer (None: tracing off; a plain lookup, cheaper than a missing key) and each
# traced request's server span.
TRACER: web.AppKey[Tracer | None] = web.AppKey("slotserve_tracer")
REQUEST_SPAN: web.RequestKey[Span] = web.RequestKey("slotserve_span")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TracingUnavailableError(RuntimeError):
    """An OTLP endpoint is set but the OpenTelemetry packages are missing (the CLI exits 2)."""


def tracing_requested(environ: Mapping[str, str]) -> bool:
    return any(environ.get(name) for name in ENDPOINT_VARS)


def tracer_provider_from_env(
    service_name: str, environ: Mapping[str, str]
) -> SdkTracerProvider | None:
    """A provider exporting over OTLP/HTTP in batches, or None when no endpoint is set.

    The exporter reads the OTEL_EXPORTER_OTLP_* variables itself (endpoint, headers, timeout);
    ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are honoured, ``service_name`` is the
    default.
    """
    if not tracing_requested(environ):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        names = " or ".join(name for name in ENDPOINT_VARS if environ.get(name))
        raise TracingUnavailableError(
            f"{names} is set (tracing on) but the OpenTelemetry packages are missing "
            f"({error.name or error}): {INSTALL_HINT}, or unset it"
        ) from error
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def shutdown_provider(provider: SdkTracerProvider | None, timeout_s: float = 5.0) -> None:
    """Export what is left, bounded: an unreachable collector must not hold up an exit."""
    if provider is None:
        return
    try:
        provider.force_flush(timeout_millis=int(timeout_s * 1000))
        provider.shutdown()
    except Exception:  # tracing is best effort; never fail a shutdown over it
        log.warning("could not flush the last spans", exc_info=True)


def install_tracing(
    app: web.Application,
    tracer_provider: TracerProvider | None,
    scope: str,
    paths: Collection[str],
) -> None:
    """Trace requests to ``paths`` with ``tracer_provider``'s tracer named ``scope``; without a
    provider, add nothing but ``app[TRACER] = None``. The middleware goes first, so it sees the
    final status of every answer, errors turned into responses by the other middlewares too."""
    if tracer_provider is None:
        app[TRACER] = None
        return
    tracer = app[TRACER] = tracer_provider.get_tracer(scope)
    app.middlewares.insert(0, server_span_middleware(tracer, paths))


def request_span(request: web.Request) -> tuple[Tracer, Span] | None:
    """The app's tracer and the request's server span, or None with tracing off."""
    tracer = request.app[TRACER]
    if tracer is None:
        return None
    span = request.get(REQUEST_SPAN)
    return None if span is None else (tracer, span)


def server_span_middleware(tracer: Tracer, paths: Collection[str]) -> Middleware:
    """A middleware that wraps each request to ``paths`` in a server span continuing the
    caller's ``traceparent``; handlers reach it as ``request[REQUEST_SPAN]``. Added to an app
    only when tracing is on."""
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        parent = propagator.extract(
            {name: request.headers[name] for name in TRACE_HEADERS if name in request.headers}
        )
        with tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path},
        ) as span:
            request[REQUEST_SPAN] = span
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
            return response

    return middleware


def inject_trace_headers(span: Span, headers: dict[str, str]) -> None:
    """Write ``span``'s context into ``headers`` as W3C ``traceparent``/``tracestate``."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
