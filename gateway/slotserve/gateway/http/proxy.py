"""Forward one admitted request to its engine and stream the answer back unbuffered.

An engine that cannot be reached, or answers 503 (draining), before the first byte is marked
failed and the request is retried on another endpoint, ahead of every waiting request. Once
bytes flow to the client there is no retry: a stream that fails after its first byte ends with an
SSE error event in OpenAI's shape and no ``data: [DONE]`` (the engine's own event passed through,
or the gateway's when the engine went away, fell silent past the read timeout, or stopped without
``[DONE]``); a non-streaming answer is read whole first, so its failure is an error status.
When the client goes away, the handler is cancelled: closing the upstream connection aborts the
request at the engine, and the slot is released in a task that the cancellation cannot
interrupt.

Engines are untrusted input: a stream is cut into events in linear time (``SseFramer``: each
chunk is searched once), an event longer than ``SSE_MAX_EVENT_BYTES`` or a whole answer longer
than ``max_answer_bytes`` marks the engine broken (offered to nobody for a while) and ends the
request with the gateway's error (an SSE error event, or 502); what a request buffers grows its
reservation in the replica's memory budget, and past the budget it ends the same way.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from functools import partial

import aiohttp
from aiohttp import web

from slotserve.contracts.headers import (
    CACHE_SALT_HEADER,
    PREEMPT_HEADER,
    QUEUE_WAIT_MS_HEADER,
    SLOTS_FREE_HEADER,
    SLOTS_TOTAL_HEADER,
)
from slotserve.gateway.admission.front import Admission, Lease
from slotserve.gateway.admission.tenants import CACHE_SALT, DEFAULT_TENANT, STREAM_TAIL
from slotserve.gateway.admission.types import RETRY_PRIORITY, AdmissionError
from slotserve.gateway.http.errors import error_response, sse_error_event
from slotserve.gateway.http.memory_budget import Reservation, request_reservation
from slotserve.gateway.http.metrics import GatewayMetrics
from slotserve.gateway.http.tracing import traced_upstream
from slotserve.gateway.pools.engines import EngineMonitor

log = logging.getLogger(__name__)

# Headers passed to the engine; everything else (Authorization included) stays here. A client's
# W3C trace context is dropped: with tracing on, the gateway's upstream span sends its own
# (tracing.py); off, a client must not choose the trace (and sampling) of engines every tenant
# shares.
FORWARD_REQUEST_HEADERS = ("Content-Type", "Accept", "X-Request-Id", "User-Agent")
FORWARD_RESPONSE_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Cache-Control",
    "X-Request-Id",
    SLOTS_FREE_HEADER,
    SLOTS_TOTAL_HEADER,
)
RETRYABLE_STATUSES = frozenset({502, 503})
SSE_CONTENT_TYPE = "text/event-stream"
SSE_TAIL_BYTES = 8192  # enough to hold the engine's last event, error message included
# One event (a token's chunk, logprobs included, is a few KiB): longer, the engine is broken.
SSE_MAX_EVENT_BYTES = 1 << 20
_SSE_DONE = re.compile(rb"\Adata: ?\[DONE\]\Z")
_SSE_ERROR = re.compile(rb'\Adata: ?\{\s*"error"\s*:')


def last_event_end(data: bytes | bytearray, start: int = 0) -> int:
    """Offset just past the last complete SSE event in ``data`` that ends after ``start`` (0:
    none)."""
    lf, crlf = data.rfind(b"\n\n", start), data.rfind(b"\r\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class EngineBrokeLimitsError(Exception):
    """The engine sent more than the gateway takes from one (an event, a whole answer)."""


class SseFramer:
    """Cuts an engine's byte stream into whole SSE events, looking at each byte once or twice:
    only the bytes since the last search are searched (rescanning all that was pending on every
    chunk cost 1.45 s of event loop for 256 KiB of 16-byte chunks)."""

    def __init__(self, max_event_bytes: int = SSE_MAX_EVENT_BYTES) -> None:
        self.pending = bytearray()
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that ``chunk`` completes (b"": none yet)."""
        start = max(0, len(self.pending) - 3)  # a blank line may straddle the two
        self.pending += chunk
        cut = last_event_end(self.pending, start)
        if len(self.pending) > self.max_event_bytes:  # rare: then every event is measured
            self._check_events(cut)
        events = b""
        if cut:
            events = bytes(self.pending[:cut])
            del self.pending[:cut]
        return events

    def _check_events(self, cut: int) -> None:
        """Raise unless every event before ``cut``, and what is pending after it, is short."""
        begin, limit = 0, self.max_event_bytes
        while begin < cut:
            window = min(cut, begin + limit + 4)
            lf = self.pending.rfind(b"\n\n", begin, window)
            crlf = self.pending.rfind(b"\r\n\r\n", begin, window)
            end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
            if end <= begin:
                break
            begin = end
        if (cut if begin < cut else len(self.pending)) - begin > limit:
            raise EngineBrokeLimitsError(f"an event longer than {limit} bytes (no blank line)")


class SseEnding:
    """Remembers the tail of a stream to tell how it ended: ``[DONE]``, an error event, or
    neither (cut short)."""

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-SSE_TAIL_BYTES:]

    def _last_event(self) -> bytes:
        events = self.tail.replace(b"\r\n", b"\n").strip().rsplit(b"\n\n", 1)
        return events[-1].strip()

    @property
    def done(self) -> bool:
        return bool(_SSE_DONE.match(self._last_event()))

    @property
    def errored(self) -> bool:
        return bool(_SSE_ERROR.match(self._last_event()))


@dataclass
class ProxyContext:
    admission: Admission
    monitor: EngineMonitor
    session: aiohttp.ClientSession
    metrics: GatewayMetrics
    max_attempts: int
    max_answer_bytes: int = 64 * 1024 * 1024  # a whole (non-streaming) answer at most


class _UpstreamFailedError(Exception):
    """The engine failed before the first byte; the request may go elsewhere."""


async def _reacquire(ctx: ProxyContext, lease: Lease, deadline: float) -> Lease:
    pool = lease.pool
    remaining = max(0.05, deadline - time.monotonic())
    return await ctx.admission.acquire(pool, RETRY_PRIORITY, remaining, slots=lease.slots)


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
    headers[CACHE_SALT_HEADER] = request.get(CACHE_SALT, DEFAULT_TENANT)  # never the client's
    attempt = 1
    while True:
        # Only a preempting grant's own lease tells its engine whom it may preempt (the client's
        # copy is never forwarded: FORWARD_REQUEST_HEADERS lists what is).
        headers.pop(PREEMPT_HEADER, None)
        if lease.preempt_tenant is not None:
            headers[PREEMPT_HEADER] = lease.preempt_tenant
        ctx.metrics.inflight.labels(pool.name, lease.endpoint).inc(lease.slots)
        try:
            forward = partial(_forward_once, request, ctx, lease, body)
            return await traced_upstream(request, lease, headers, forward)
        except _UpstreamFailedError as exc:
            ctx.monitor.mark_failed(lease.endpoint)
            log.warning("engine %s failed before the first byte: %s", lease.endpoint, exc)
            if attempt >= ctx.max_attempts:
                return error_response(
                    502, f"no engine of pool {pool.name!r} answered: {exc}", "upstream_failed"
                )
        finally:
            ctx.metrics.inflight.labels(pool.name, lease.endpoint).dec(lease.slots)
            ctx.admission.release_soon(lease)
        attempt += 1
        try:
            lease = await _reacquire(ctx, lease, deadline)
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
    except aiohttp.SocketTimeoutError:
        # The engine took the request and stayed silent: retrying it elsewhere would cost
        # another engine as long, and a request that hangs engines would hang them all.
        ctx.metrics.upstream_errors.labels(lease.endpoint, "timeout").inc()
        return error_response(504, _silence_message(ctx, lease), "upstream_timeout")
    except (aiohttp.ClientError, TimeoutError) as exc:
        ctx.metrics.upstream_errors.labels(lease.endpoint, "connect").inc()
        raise _UpstreamFailedError(str(exc) or type(exc).__name__) from exc
    finished = False
    try:
        if upstream.status in RETRYABLE_STATUSES:
            ctx.metrics.upstream_errors.labels(lease.endpoint, "status").inc()
            raise _UpstreamFailedError(f"HTTP {upstream.status}")
        reservation = request_reservation(request)
        if upstream.content_type != SSE_CONTENT_TYPE:
            return await _forward_whole(ctx, lease, upstream, reservation)
        response = web.StreamResponse(status=upstream.status)
        _copy_headers(upstream, response, lease)
        await response.prepare(request)
        finished = await _forward_stream(ctx, lease, upstream, response, reservation)
        await response.write_eof()
        return response
    finally:
        if finished:
            upstream.release()
        else:
            upstream.close()  # drops the connection: the engine aborts the request


def _copy_headers(
    upstream: aiohttp.ClientResponse, response: web.StreamResponse, lease: Lease
) -> None:
    for name in FORWARD_RESPONSE_HEADERS:
        if name in upstream.headers:
            response.headers[name] = upstream.headers[name]
    response.headers[QUEUE_WAIT_MS_HEADER] = f"{lease.queue_wait_s * 1000:.1f}"


def _silence_message(ctx: ProxyContext, lease: Lease) -> str:
    timeout_s = ctx.session.timeout.sock_read
    return f"engine {lease.endpoint} sent nothing for {timeout_s:g} s"


def _broken(ctx: ProxyContext, lease: Lease, what: str) -> str:
    """An engine that broke the gateway's limits: offered to nobody for a while."""
    ctx.metrics.upstream_errors.labels(lease.endpoint, "limits").inc()
    ctx.monitor.mark_broken(lease.endpoint)
    log.warning("engine %s broke the gateway's limits: %s; marked down", lease.endpoint, what)
    return f"engine {lease.endpoint} sent {what}"


OVER_BUDGET = "the answer does not fit this gateway replica's memory budget now; try again shortly"


async def _forward_whole(
    ctx: ProxyContext,
    lease: Lease,
    upstream: aiohttp.ClientResponse,
    reservation: Reservation | None,
) -> web.StreamResponse:
    """A non-streaming answer, read whole before anything is sent: the engine sends it at once
    anyway, and a failure half-way can still become a proper error status instead of a
    truncated body behind a 200. At most ``max_answer_bytes``, within the memory budget."""
    limit = ctx.max_answer_bytes
    base = reservation.num_bytes if reservation is not None else 0
    data = bytearray()
    try:
        if upstream.content_length is not None and upstream.content_length > limit:
            message = _broken(ctx, lease, f"an answer of {upstream.content_length} bytes")
            return error_response(502, f"{message} (at most {limit})", "upstream_too_large")
        while chunk := await upstream.content.readany():
            data += chunk
            if len(data) > limit:
                message = _broken(ctx, lease, f"an answer longer than {limit} bytes")
                return error_response(502, message, "upstream_too_large")
            if reservation is not None and not reservation.resize(base + len(data)):
                return error_response(503, OVER_BUDGET, "memory_budget_exceeded", retry_after_s=1)
    except aiohttp.SocketTimeoutError:
        ctx.metrics.upstream_errors.labels(lease.endpoint, "timeout").inc()
        return error_response(504, _silence_message(ctx, lease), "upstream_timeout")
    except (aiohttp.ClientError, TimeoutError) as exc:
        ctx.metrics.upstream_errors.labels(lease.endpoint, "body").inc()
        log.warning("engine %s failed mid-answer: %s", lease.endpoint, exc)
        message = f"engine {lease.endpoint} failed before its answer was complete"
        return error_response(502, message, "upstream_failed")
    response = web.Response(status=upstream.status, body=bytes(data))
    _copy_headers(upstream, response, lease)
    return response


async def _forward_stream(
    ctx: ProxyContext,
    lease: Lease,
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    reservation: Reservation | None,
) -> bool:
    """Pass an SSE stream through, event by event, as it arrives. Returns whether it ended with
    ``[DONE]``; otherwise the client's stream ends with an error event (the engine's own when it
    sent one, else the gateway's) and never with a ``[DONE]`` that would claim success.

    Only whole events are written, so when the engine goes away mid-event the client never
    sees half an event glued to the error event.
    """
    ending = SseEnding()
    framer = SseFramer()
    base = reservation.num_bytes if reservation is not None else 0
    failure: str | None = None
    while True:
        try:
            chunk = await upstream.content.readany()
        except aiohttp.SocketTimeoutError:
            failure, code = _silence_message(ctx, lease), "upstream_timeout"
            ctx.metrics.upstream_errors.labels(lease.endpoint, "timeout").inc()
            break
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure, code = f"engine {lease.endpoint} went away mid-stream", "upstream_failed"
            ctx.metrics.upstream_errors.labels(lease.endpoint, "stream").inc()
            log.warning("engine %s failed mid-stream: %s", lease.endpoint, exc)
            break
        if not chunk:  # the engine ended the stream
            pending = bytes(framer.pending)
            if pending:  # a last event without its blank line: pass it on as it is
                ending.feed(pending)
                await response.write(pending if pending.endswith(b"\n") else pending + b"\n")
                await response.write(b"\n")
            break
        try:
            events = framer.feed(chunk)
        except EngineBrokeLimitsError as exc:
            failure, code = _broken(ctx, lease, str(exc)), "upstream_too_large"
            break
        if reservation is not None and not reservation.resize(base + len(framer.pending)):
            failure, code = OVER_BUDGET, "memory_budget_exceeded"
            break
        if events:
            ending.feed(events)
            await response.write(events)
    response[STREAM_TAIL] = ending.tail  # its usage event, if any, counts the tenant's tokens
    if failure is None:
        if ending.done:
            return True
        if ending.errored:
            ctx.metrics.upstream_errors.labels(lease.endpoint, "engine_error_event").inc()
            return False  # the engine's own error event is already the last thing sent
        failure, code = (
            f"engine {lease.endpoint} ended the stream without [DONE]",
            "upstream_incomplete",
        )
        ctx.metrics.upstream_errors.labels(lease.endpoint, "incomplete").inc()
    status = 503 if code == "memory_budget_exceeded" else 502
    await response.write(sse_error_event(status, failure, code))
    return False
