"""The tenant's gate in front of admission: quotas, the cache salt, per-tenant counts.

``tenant_middleware`` runs innermost (after authentication and the body's limits) on the
completion paths: it finds the caller's tenant (``ApiKeys.tenant_of``), takes the tenant's quotas
(``quotas.py``; refused: 429 with the bucket's ``Retry-After``, or at once without one for a quota
of zero), marks the request with the tenant as its cache salt (the proxy sends it to the engine),
and hands the request on to admission. Whatever way the request ends (answer, error, a client
that went away), its in-flight place is given back in a task its cancellation cannot interrupt,
as admission gives back its slot (``Admission.release_soon``), and a non-streaming answer's
``usage`` corrects the tokens it was charged.

While a request holds its place, this replica refreshes it every third of the lease TTL; a
replica that dies stops refreshing, and its places expire after one TTL (like its leases).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web

from slotserve.gateway.admission.quotas import InProcessQuotas, QuotaRefusal, QuotaStore
from slotserve.gateway.admission.tenants import CACHE_SALT, STREAM_TAIL, TENANT, Tenant
from slotserve.gateway.http.api_keys import ApiKeys
from slotserve.gateway.http.errors import error_response
from slotserve.gateway.http.metrics import GatewayMetrics
from slotserve.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
BYTES_PER_TOKEN = 4  # a generous prompt count from the body's size (JSON included)
MAX_ERROR_BODY = 4096  # an error answer's code is read from bodies this small only

# Outcome labels taken from an error's code: the gateway's own and the quotas'. Anything else
# (an engine's code: engines are untrusted input) is counted by its status, so a label never
# takes a value an engine chose.
KNOWN_CODES = frozenset(
    {
        "queue_full",
        "queue_timeout",
        "admission_backend_unavailable",
        "admission_error",
        "no_ready_endpoint",
        "invalid_value",
        "invalid_json",
        "invalid_header",
        "missing_model",
        "model_not_found",
        "priority_not_allowed",
        "upstream_failed",
        "upstream_timeout",
        "upstream_too_large",
        "memory_budget_exceeded",
        "backend_unavailable",
    }
)
REFUSAL_MESSAGES = {
    "max_inflight": "has as many requests in flight as its limit allows",
    "requests_per_minute": "has used its requests per minute",
    "tokens_per_minute": "has used its tokens per minute",
}


def estimate_tokens(body: bytes, payload: dict[str, Any] | None) -> int:
    """Prompt tokens from the body's size, plus every choice's ``max_tokens`` when given."""
    prompt = math.ceil(len(body) / BYTES_PER_TOKEN)
    if payload is None:
        return prompt
    max_tokens = payload.get(
        "max_completion_tokens", payload.get("max_tokens", payload.get("max_output_tokens"))
    )
    n = payload.get("n", 1)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        max_tokens = 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        n = 1
    return prompt + n * max_tokens


def _payload(body: bytes) -> dict[str, Any] | None:
    try:
        payload = json.loads(body)  # bounded already (request_limits.check_json_bounds)
    except (ValueError, RecursionError):
        return None  # the handler answers 400
    return payload if isinstance(payload, dict) else None


def _answer_json(response: web.StreamResponse, limit: int | None = None) -> dict[str, Any] | None:
    if not isinstance(response, web.Response) or not isinstance(response.body, bytes):
        return None  # a stream: what it sent is gone
    if limit is not None and len(response.body) > limit:
        return None
    return _payload(response.body)


def _stream_usage(tail: bytes) -> dict[str, Any] | None:
    """The last ``usage`` object among a stream's last events (vLLM and OpenAI send it in a
    chunk of its own before ``[DONE]`` when asked with ``stream_options.include_usage``)."""
    for line in reversed(tail.splitlines()):
        if line.startswith(b"data:") and b'"usage"' in line:
            event = _payload(line[5:].strip())
            usage = event.get("usage") if event is not None else None
            if isinstance(usage, dict):
                return usage
    return None


def usage_tokens(response: web.StreamResponse) -> int | None:
    """Prompt + completion tokens of an answer's ``usage`` (None: not there): a whole answer's,
    or a stream's usage event."""
    if isinstance(response, web.Response):
        answer = _answer_json(response)
        usage = answer.get("usage") if answer is not None else None
    else:
        usage = _stream_usage(response.get(STREAM_TAIL, b""))
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total
    return None


def outcome_of(response: web.StreamResponse) -> str:
    """The per-tenant outcome label: ``answered``, or the error's code (``queue_full``, ...)."""
    if response.status < 400:
        return "answered"
    answer = _answer_json(response, MAX_ERROR_BODY)
    error = answer.get("error") if answer is not None else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if code in KNOWN_CODES else f"http_{response.status}"


class TenantGate:
    """Quotas of one replica's requests: takes, releases, refreshes, corrects and counts."""

    def __init__(
        self, store: QuotaStore, metrics: GatewayMetrics, refresh_interval_s: float
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.refresh_interval_s = refresh_interval_s
        self.held: dict[str, Tenant] = {}  # request id -> its tenant, while in flight here
        self._background: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def take(self, tenant: Tenant, request_id: str, cost: int) -> QuotaRefusal | None:
        refusal = await self.store.take(tenant, request_id, cost)
        if refusal is None:
            self.held[request_id] = tenant
            self.metrics.tenant_inflight.labels(tenant.name).inc()
            self.metrics.tenant_tokens.labels(tenant.name, "estimated").inc(cost)
        return refusal

    async def finish(self, tenant: Tenant, request_id: str, correction: int | None) -> None:
        """Give the place back and correct the tokens charged; never raises."""
        if self.held.pop(request_id, None) is not None:
            self.metrics.tenant_inflight.labels(tenant.name).dec()
        try:
            if tenant.max_inflight is not None:
                await self.store.release(tenant, request_id)
            if correction:
                await self.store.charge(tenant, correction)
        except Exception:
            # Unreleased, the place expires after one TTL without this replica's refresh.
            log.warning("tenant %s: quota release failed", tenant.name, exc_info=True)

    async def refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            by_tenant: dict[str, tuple[Tenant, list[str]]] = {}
            for request_id, tenant in list(self.held.items()):
                if tenant.max_inflight is not None:
                    by_tenant.setdefault(tenant.name, (tenant, []))[1].append(request_id)
            for tenant, ids in by_tenant.values():
                try:
                    await self.store.refresh(tenant, ids)
                except Exception:
                    log.warning("tenant %s: quota refresh failed", tenant.name, exc_info=True)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=2)
        await self.store.close()


TENANT_GATE = web.AppKey("tenant_gate", TenantGate)
TENANT_KEYS = web.AppKey("tenant_keys", ApiKeys)


def _refused(tenant: Tenant, refusal: QuotaRefusal) -> web.Response:
    if refusal.retry_after_s is None:
        # OpenAI's code for a quota that is used up for good: a retry cannot help.
        return error_response(
            429,
            f"tenant {tenant.name!r} has a quota of zero: every request is refused",
            "insufficient_quota",
        )
    what = REFUSAL_MESSAGES.get(refusal.reason, "is over a quota")
    return error_response(
        429,
        f"tenant {tenant.name!r} {what}; retry after {refusal.retry_after_s} s",
        refusal.reason,
        retry_after_s=refusal.retry_after_s,
    )


@web.middleware
async def tenant_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.path not in GATED_PATHS:
        return await handler(request)
    gate = request.app[TENANT_GATE]
    tenant = request.app[TENANT_KEYS].tenant_of(request.headers.get("Authorization", ""))
    request[CACHE_SALT] = tenant.name
    request[TENANT] = tenant
    m = gate.metrics
    if not tenant.limited:
        response = await handler(request)
        m.tenant_requests.labels(tenant.name, outcome_of(response)).inc()
        return response
    body = await request.read()  # read already, within its limits (request_limits.py)
    cost = estimate_tokens(body, _payload(body) if tenant.tokens_per_minute else None)
    request_id = uuid.uuid4().hex
    try:
        refusal = await gate.take(tenant, request_id, cost)
    except Exception as exc:  # Redis unreachable: as admission answers then
        log.warning("tenant %s: quota check failed: %s", tenant.name, exc)
        m.tenant_requests.labels(tenant.name, "backend_unavailable").inc()
        return error_response(
            503,
            "the quota store is unavailable; retry shortly",
            "backend_unavailable",
            retry_after_s=1,
        )
    if refusal is not None:
        m.tenant_requests.labels(tenant.name, refusal.reason).inc()
        return _refused(tenant, refusal)
    correction: int | None = None
    try:
        response = await handler(request)
        used = usage_tokens(response)
        if used is not None:
            correction = used - cost
            m.tenant_tokens.labels(tenant.name, "counted").inc(used)
        elif response.status >= 400 and isinstance(response, web.Response):
            correction = -cost  # refused or failed before any work: nothing was used
        m.tenant_requests.labels(tenant.name, outcome_of(response)).inc()
        return response
    finally:
        # In its own task, so that a client that went away cancels this handler, not the
        # release. With a max-inflight place it is awaited (shielded), so that a whole answer
        # leaves only once the place is back: the client's next request, on any replica, must
        # find it free; a token correction alone need not hold the answer.
        finished = gate.spawn(gate.finish(tenant, request_id, correction))
        if tenant.max_inflight is not None:
            await asyncio.shield(finished)


async def _gate_ctx(app: web.Application) -> AsyncIterator[None]:
    gate = app[TENANT_GATE]
    refresher = asyncio.create_task(gate.refresh_loop(), name="tenant-quota-refresh")
    yield
    refresher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await refresher
    await gate.close()


def install_tenants(
    app: web.Application, settings: GatewaySettings, keys: ApiKeys, metrics: GatewayMetrics
) -> None:
    """Put the tenant gate into ``app`` (innermost middleware, its store, its refresh task)."""
    ttl_s = settings.lease_ttl_seconds
    store: QuotaStore
    if settings.redis_url:
        from slotserve.gateway.admission.quotas_redis import RedisQuotas

        store = RedisQuotas(settings.redis_url, settings.redis_prefix, ttl_s)
    else:
        store = InProcessQuotas(ttl_s)
    app[TENANT_GATE] = TenantGate(store, metrics, ttl_s / 3)
    app[TENANT_KEYS] = keys
    app.middlewares.append(tenant_middleware)
    app.cleanup_ctx.append(_gate_ctx)
