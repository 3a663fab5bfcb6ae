"""The gateway's aiohttp application: ``create_app(settings)``.

Start-up order (cleanup contexts): pools -> engine monitor -> admission -> upstream session.
Shutdown runs them in reverse: stop taking requests, close the upstream session, stop admission
(leases not released by then expire after the lease TTL), stop polling engines, stop watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotserve.gateway.admission import Admission
from slotserve.gateway.admission_types import (
    AdmissionBackend,
    AdmissionError,
    PoolPolicy,
)
from slotserve.gateway.admission_window import AdmissionWindowWriter
from slotserve.gateway.api_keys import ApiKeys
from slotserve.gateway.config import PoolRegistry, load_pools, watch_pool_file
from slotserve.gateway.discovery import PoolCatalog, start_kubernetes_watch
from slotserve.gateway.engines import EngineMonitor
from slotserve.gateway.errors import error_response
from slotserve.gateway.memory_backend import InProcessBackend, InProcessHub
from slotserve.gateway.metrics import GatewayMetrics
from slotserve.gateway.proxy import ProxyContext, proxy_request
from slotserve.gateway.settings import GatewaySettings
from slotserve.gateway.tracing import traced_admission
from slotserve.tracing import install_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", GatewaySettings)
REGISTRY = web.AppKey("registry", PoolRegistry)
METRICS = web.AppKey("metrics", GatewayMetrics)
MONITOR = web.AppKey("monitor", EngineMonitor)
ADMISSION = web.AppKey("admission", Admission)
PROXY = web.AppKey("proxy", ProxyContext)
API_KEYS = web.AppKey("api_keys", ApiKeys)
# Admission counts for the operator's status.admission: with Redis only (None without).
WINDOW: web.AppKey[AdmissionWindowWriter | None] = web.AppKey("admission_window")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Probes never carry credentials; /metrics joins them unless metrics_require_api_key is set.
PROBE_PATHS = frozenset({"/health", "/ready"})


def _replica_id(settings: GatewaySettings) -> str:
    if settings.replica_id:
        return settings.replica_id
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# -- middleware ----------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _needs_api_key(request: web.Request) -> bool:
    if request.path in PROBE_PATHS:
        return False
    return request.path != "/metrics" or request.app[SETTINGS].metrics_require_api_key


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[API_KEYS]
    authorization = request.headers.get("Authorization", "")
    if keys.enabled and _needs_api_key(request) and not keys.accepts(authorization):
        return error_response(
            401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key"
        )
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"request body too large: {exc.text}", "body_too_large")
    except web.HTTPException as exc:
        # aiohttp's own 404/405 (unknown path, wrong method) in OpenAI's shape, not plain text.
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, exc.reason.lower().replace(" ", "_"))


# -- handlers ------------------------------------------------------------------------------------


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    admission = request.app[ADMISSION]
    monitor = request.app[MONITOR]
    registry = request.app[REGISTRY]
    # Ready once the first full list of pools is in and all its endpoints were polled once.
    synced_version = registry.synced_version
    is_ready = synced_version is not None and monitor.polled_version >= synced_version
    body = {
        "admission_backend": "up" if admission.backend_ok else "down",
        "pools_listed": synced_version is not None,
        "pools": {
            name: {"usable_endpoints": len(monitor.offers(name))} for name in sorted(registry.pools)
        },
    }
    return web.json_response(body, status=200 if is_ready else 503)


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    admission = request.app[ADMISSION]
    for name in request.app[REGISTRY].pools:
        m.queue_size.labels(name).set(admission.queue_depth(name))
    m.backend_up.set(1 if admission.backend_ok else 0)
    return web.Response(
        body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def list_models(request: web.Request) -> web.Response:
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "slotserve"}
        for name in sorted(request.app[REGISTRY].pools)
    ]
    return web.json_response({"object": "list", "data": data})


def _header_int(request: web.Request, name: str, low: int, high: int) -> int | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"header {name} must be an integer, got {raw[:40]!r}") from None
    if not low <= value <= high:
        raise ValueError(f"header {name} must be between {low} and {high}, got {value}")
    return value


def _default_priority(policy: PoolPolicy, gateway_default: int, allowed: range) -> int:
    """A request without the header: the pool's default level, else the gateway's, brought
    into the levels the pool has and then into those the caller's key may ask for."""
    level = policy.default_priority_level or gateway_default
    level = min(level, policy.priority_levels)
    if allowed:
        level = min(max(level, allowed.start), allowed.stop - 1)
    return level


def _reject_constant(name: str) -> None:
    raise ValueError(f"request body is not valid JSON: {name} is not a JSON number")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ValueError with a message for the client.

    Hostile bodies end here as 400s: nesting deep enough to exhaust the parser's recursion,
    NaN/Infinity (not JSON; an engine would choke on them later), bytes that are not UTF-8.
    """
    try:
        payload = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("request body is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ValueError("request body must be a JSON object")
    return payload


def requested_slots(payload: dict[str, Any]) -> int:
    """The engine slots a request takes: one per choice (``n``). A malformed ``n`` counts one:
    the engine refuses it (400 naming ``n``) without taking a slot."""
    n = payload.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return 1


async def completions(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    m = request.app[METRICS]
    body = await request.read()
    try:
        payload = parse_json_object(body)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return error_response(400, "'model' (a string) is required", "missing_model", param="model")
    pool = request.app[REGISTRY].get(model)
    if pool is None:
        return error_response(
            404, f"model {model!r} is not served here", "model_not_found", param="model"
        )
    policy = pool.policy
    try:
        priority = _header_int(request, "x-slotserve-priority", 1, policy.priority_levels)
        deadline_ms = _header_int(request, "x-slotserve-deadline-ms", 1, 3_600_000)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_header")
    allowed = request.app[API_KEYS].allowed_levels(request.headers.get("Authorization", ""))
    if priority is None:
        priority = _default_priority(policy, settings.default_priority, allowed)
    elif priority not in allowed:
        return error_response(
            403,
            f"this API key may not ask for priority {priority} "
            f"(allowed: {allowed.start}-{allowed.stop - 1})",
            "priority_not_allowed",
        )
    # A client may only shorten the wait (x-slotserve-deadline-ms).
    wait = policy.queue_wait(priority, None if deadline_ms is None else deadline_ms / 1000)
    timeout_s = wait.give_up_after_s
    deadline = time.monotonic() + timeout_s
    admission = request.app[ADMISSION]
    window = request.app[WINDOW]
    offers = request.app[MONITOR].offers(model)
    if not offers:
        m.rejected.labels(model, "no_ready_endpoint").inc()
        if window is not None:
            window.rejected(model, "no_ready_endpoint")
        return error_response(
            503, f"no engine of pool {model!r} is ready", "no_ready_endpoint", retry_after_s=1
        )
    slots = requested_slots(payload)
    most_slots = max(offer.slots_total for offer in offers)
    if slots > most_slots:
        # Refused before queueing, as the engine would: no endpoint could ever hold it.
        m.rejected.labels(model, "invalid_value").inc()
        return error_response(
            400,
            f"'n' ({slots}) exceeds the slots of every engine of pool {model!r} "
            f"(at most {most_slots}): each choice takes one",
            "invalid_value",
            param="n",
        )
    try:
        acquire = admission.acquire(
            policy, priority, timeout_s, demote_after_s=wait.demote_after_s, slots=slots
        )
        lease = await traced_admission(request, model, acquire)
    except AdmissionError as exc:
        m.rejected.labels(model, exc.code).inc()
        if window is not None:
            window.rejected(model, exc.code)
        return error_response(exc.status, exc.message, exc.code, retry_after_s=exc.retry_after_s)
    m.admitted.labels(model).inc()
    m.queue_wait.labels(model).observe(lease.queue_wait_s)
    if window is not None:
        window.admitted(model, lease.queue_wait_s)
    try:
        return await proxy_request(request, request.app[PROXY], lease, body, deadline)
    except ConnectionResetError:
        return web.Response(status=499)  # client went away; nothing to send


# -- resources (cleanup contexts) ----------------------------------------------------------------


async def api_keys_ctx(app: web.Application) -> AsyncIterator[None]:
    keys = app[API_KEYS]
    watcher = None
    if keys.enabled:
        interval_s = app[SETTINGS].api_keys_poll_interval_seconds
        watcher = asyncio.create_task(keys.watch(interval_s), name="api-keys-watch")
    yield
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def pools_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    registry = app[REGISTRY]
    watcher: asyncio.Task[None] | None = None
    if settings.discovery == "kubernetes":
        sources = settings.namespaces or [""]  # "": every namespace
        conflicts = app[METRICS].pool_conflicts
        catalog = PoolCatalog(registry, sources, lambda model: conflicts.labels(model).inc())
        start_kubernetes_watch(catalog, sources, asyncio.get_running_loop())
    elif settings.config is not None:
        registry.replace(load_pools(settings.config))
        registry.mark_synced()
        watcher = asyncio.create_task(watch_pool_file(settings.config, registry))
    yield
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def monitor_ctx(app: web.Application) -> AsyncIterator[None]:
    monitor = app[MONITOR]
    await monitor.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(monitor.first_round.wait(), 2.0)
    yield
    await monitor.close()


def make_backend(settings: GatewaySettings) -> AdmissionBackend:
    replica_id = _replica_id(settings)
    if settings.redis_url:
        from slotserve.gateway.redis_backend import RedisBackend

        return RedisBackend(
            settings.redis_url,
            replica_id,
            prefix=settings.redis_prefix,
            lease_ttl_s=settings.lease_ttl_seconds,
        )
    return InProcessBackend(InProcessHub(settings.lease_ttl_seconds), replica_id)


async def admission_ctx(app: web.Application) -> AsyncIterator[None]:
    admission = app[ADMISSION]
    await admission.start()
    yield
    await admission.close()


async def admission_window_ctx(app: web.Application) -> AsyncIterator[None]:
    window = app[WINDOW]
    if window is not None:
        window.start()
    yield
    if window is not None:
        await window.close()


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # No total: a long generation streams for as long as it needs. What is bounded is silence:
    # each read (the answer's headers, then every chunk) must come within the read timeout.
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.upstream_connect_timeout_seconds,
        sock_read=settings.upstream_read_timeout_seconds,
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
    app[PROXY] = ProxyContext(
        app[ADMISSION], app[MONITOR], session, app[METRICS], settings.max_attempts
    )
    yield
    await session.close()


def create_app(
    settings: GatewaySettings, tracer_provider: TracerProvider | None = None
) -> web.Application:
    """Build the gateway app; resources start with the app and stop with it. With a
    ``tracer_provider`` the completion requests are traced (slotserve/tracing.py)."""
    app = web.Application(
        middlewares=[auth_middleware], client_max_size=settings.max_request_body_bytes
    )
    app[SETTINGS] = settings
    registry = app[REGISTRY] = PoolRegistry()
    app[METRICS] = GatewayMetrics()
    app[API_KEYS] = ApiKeys(settings.api_keys_file)  # ApiKeysError: the CLI exits with 2
    if not app[API_KEYS].enabled:
        log.warning(
            "no API keys file: every caller is accepted (set --api-keys-file to require keys)"
        )
    monitor = app[MONITOR] = EngineMonitor(registry, settings.load_poll_interval_seconds)
    app[ADMISSION] = Admission(
        make_backend(settings),
        offers=monitor.offers,
        pools=registry.policies,
        lease_ttl_s=settings.lease_ttl_seconds,
        priority_aging_s=settings.priority_aging_seconds,
    )
    app[WINDOW] = None
    if settings.redis_url:
        from slotserve.gateway.redis_backend import make_client

        app[WINDOW] = AdmissionWindowWriter(make_client(settings.redis_url), settings.redis_prefix)
    app.cleanup_ctx.extend(
        [api_keys_ctx, pools_ctx, monitor_ctx, admission_ctx, admission_window_ctx, upstream_ctx]
    )
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, completions)
    install_tracing(app, tracer_provider, "slotserve.gateway", COMPLETION_PATHS)
    return app
