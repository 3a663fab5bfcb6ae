"""Forward one admitted request to its engine and stream the answer back unbuffered.

An engine that cannot be reached, or answers 503 (draining), before the first byte is marked
failed and the request is retried on another endpoint, ahead of every waiting request. Once
bytes flow to the client there is no retry. When the client goes away, the handler is cancelled:
leaving the ``async with`` closes the upstream connection, which aborts the request at the engine,
and the slot is released in a task that the cancellation cannot interrupt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from slotserve.gateway.admission import Admission, Lease
from slotserve.gateway.admission_types import RETRY_PRIORITY, AdmissionError, PoolPolicy
from slotserve.gateway.engines import EngineMonitor
from slotserve.gateway.errors import error_response
from slotserve.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# Headers passed to the engine; everything else (Authorization included) stays here.
FORWARD_REQUEST_HEADERS = ("Content-Type", "Accept", "X-Request-Id", "User-Agent")
FORWARD_RESPONSE_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Cache-Control",
    "X-Request-Id",
    "x-slotserve-slots-free",
    "x-slotserve-slots-total",
)
RETRYABLE_STATUSES = frozenset({502, 503})


@dataclass
class ProxyContext:
    admission: Admission
    monitor: EngineMonitor
    session: aiohttp.ClientSession
    metrics: GatewayMetrics
    max_attempts: int


class _UpstreamFailedError(Exception):
    """The engine failed before the first byte; the request may go elsewhere."""


async def _reacquire(ctx: ProxyContext, pool: PoolPolicy, deadline: float) -> Lease:
    remaining = max(0.05, deadline - time.monotonic())
    return await ctx.admission.acquire(pool, RETRY_PRIORITY, remaining)


async def proxy_request(
    request: web.Request,
    ctx: ProxyContext,
    lease: Lease,
    body: bytes,
    deadline: float,
) -> web.StreamResponse:
    """Send ``body`` to the lease's engine (retrying elsewhere on early failure) and stream back."""
    pool = lease.pool
    headers = {h: request.headers[h] for h in FORWARD_REQUEST_HEADERS if h in request.headers}
    attempt = 1
    while True:
        ctx.metrics.inflight.labels(pool.name, lease.endpoint).inc()
        try:
            return await _forward_once(request, ctx, lease, body, headers)
        except _UpstreamFailedError as exc:
            ctx.monitor.mark_failed(lease.endpoint)
            log.warning("engine %s failed before the first byte: %s", lease.endpoint, exc)
            if attempt >= ctx.max_attempts:
                return error_response(
                    502, f"no engine of pool {pool.name!r} answered: {exc}", "upstream_failed"
                )
        finally:
            ctx.metrics.inflight.labels(pool.name, lease.endpoint).dec()
            ctx.admission.release_soon(lease)
        attempt += 1
        try:
            lease = await _reacquire(ctx, pool, deadline)
        except AdmissionError as exc:
            return error_response(
                exc.status, exc.message, exc.code, retry_after_s=exc.retry_after_s
            )


async def _forward_once(
    request: web.Request,
    ctx: ProxyContext,
    lease: Lease,
    body: bytes,
    headers: dict[str, str],
) -> web.StreamResponse:
    url = f"{lease.endpoint}{request.path}"
    try:
        upstream = await ctx.session.post(url, data=body, headers=headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        ctx.metrics.upstream_errors.labels(lease.endpoint, "connect").inc()
        raise _UpstreamFailedError(str(exc) or type(exc).__name__) from exc
    finished = False
    try:
        if upstream.status in RETRYABLE_STATUSES:
            ctx.metrics.upstream_errors.labels(lease.endpoint, "status").inc()
            raise _UpstreamFailedError(f"HTTP {upstream.status}")
        response = web.StreamResponse(status=upstream.status)
        for name in FORWARD_RESPONSE_HEADERS:
            if name in upstream.headers:
                response.headers[name] = upstream.headers[name]
        response.headers["x-slotserve-queue-wait-ms"] = f"{lease.queue_wait_s * 1000:.1f}"
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
            # Bytes already reached the client: no retry, just end the stream.
            ctx.metrics.upstream_errors.labels(lease.endpoint, "stream").inc()
            log.warning("engine %s failed mid-response: %s", lease.endpoint, exc)
            return response
        await response.write_eof()
        finished = True
        return response
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # drops the connection: the engine aborts the request
