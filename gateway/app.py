"""The gateway's aiohttp application: ``create_app(settings)``.

Start-up order (cleanup contexts): pools -> engine monitor -> admission -> upstream session.
Shutdown runs them in reverse: stop taking requests, close the upstream session, stop admission
(leases not released by then expire after the lease TTL), stop polling engines, stop watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotserve.gateway.admission import Admission
from slotserve.gateway.admission_types import (
    MAX_PRIORITY_LEVEL,
    AdmissionBackend,
    AdmissionError,
)
from slotserve.gateway.config import PoolRegistry, load_pools, watch_pool_file
from slotserve.gateway.discovery import start_kubernetes_watch
from slotserve.gateway.engines import EngineMonitor
from slotserve.gateway.errors import error_response
from slotserve.gateway.memory_backend import InProcessBackend, InProcessHub
from slotserve.gateway.metrics import GatewayMetrics
from slotserve.gateway.proxy import ProxyContext, proxy_request
from slotserve.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", GatewaySettings)
REGISTRY = web.AppKey("registry", PoolRegistry)
METRICS = web.AppKey("metrics", GatewayMetrics)
MONITOR = web.AppKey("monitor", EngineMonitor)
ADMISSION = web.AppKey("admission", Admission)
PROXY = web.AppKey("proxy", ProxyContext)
API_KEYS = web.AppKey("api_keys", frozenset)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})


def load_api_keys(path: Path) -> frozenset[str]:
    """One key per line; blank lines and lines starting with # are ignored."""
    lines = path.read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def _replica_id(settings: GatewaySettings) -> str:
    if settings.replica_id:
        return settings.replica_id
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# -- middleware ----------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[API_KEYS]
    if keys and request.path not in PUBLIC_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        valid = scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.encode(), key.encode()) for key in keys
        )
        if not valid:
            return error_response(
                401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key"
            )
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, f"request body too large: {exc.text}", "body_too_large")


# -- handlers ------------------------------------------------------------------------------------


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    admission = request.app[ADMISSION]
    monitor = request.app[MONITOR]
    pools = request.app[REGISTRY].pools
    body = {
        "admission_backend": "up" if admission.backend_ok else "down",
        "pools": {name: {"usable_endpoints": len(monitor.offers(name))} for name in sorted(pools)},
    }
    return web.json_response(body, status=200 if monitor.first_round.is_set() else 503)


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


async def completions(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    m = request.app[METRICS]
    body = await request.read()
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}", "invalid_json")
    if not isinstance(payload, dict):
        return error_response(400, "request body must be a JSON object", "invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return error_response(400, "'model' (a string) is required", "missing_model", param="model")
    pool = request.app[REGISTRY].get(model)
    if pool is None:
        return error_response(
            404, f"model {model!r} is not served here", "model_not_found", param="model"
        )
    try:
        priority = _header_int(request, "x-slotserve-priority", 1, MAX_PRIORITY_LEVEL)
        deadline_ms = _header_int(request, "x-slotserve-deadline-ms", 1, 3_600_000)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_header")
    policy = pool.policy
    timeout_s = policy.queue_timeout_s
    if deadline_ms is not None:
        timeout_s = min(timeout_s, deadline_ms / 1000)  # a client may only shorten it
    deadline = time.monotonic() + timeout_s
    admission = request.app[ADMISSION]
    if not request.app[MONITOR].offers(model):
        m.rejected.labels(model, "no_ready_endpoint").inc()
        return error_response(
            503, f"no engine of pool {model!r} is ready", "no_ready_endpoint", retry_after_s=1
        )
    try:
        lease = await admission.acquire(policy, priority or settings.default_priority, timeout_s)
    except AdmissionError as exc:
        m.rejected.labels(model, exc.code).inc()
        return error_response(exc.status, exc.message, exc.code, retry_after_s=exc.retry_after_s)
    m.admitted.labels(model).inc()
    m.queue_wait.labels(model).observe(lease.queue_wait_s)
    try:
        return await proxy_request(request, request.app[PROXY], lease, body, deadline)
    except ConnectionResetError:
        return web.Response(status=499)  # client went away; nothing to send


# -- resources (cleanup contexts) ----------------------------------------------------------------


async def pools_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    registry = app[REGISTRY]
    watcher: asyncio.Task[None] | None = None
    if settings.discovery == "kubernetes":
        start_kubernetes_watch(registry, settings.namespaces, asyncio.get_running_loop())
    elif settings.config is not None:
        registry.replace(load_pools(settings.config))
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


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    timeout = aiohttp.ClientTimeout(
        total=settings.upstream_timeout_seconds,
        sock_connect=settings.upstream_connect_timeout_seconds,
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
    app[PROXY] = ProxyContext(
        app[ADMISSION], app[MONITOR], session, app[METRICS], settings.max_attempts
    )
    yield
    await session.close()


def create_app(settings: GatewaySettings) -> web.Application:
    """Build the gateway app; resources start with the app and stop with it."""
    app = web.Application(
        middlewares=[auth_middleware], client_max_size=settings.max_request_body_bytes
    )
    app[SETTINGS] = settings
    registry = app[REGISTRY] = PoolRegistry()
    app[METRICS] = GatewayMetrics()
    app[API_KEYS] = load_api_keys(settings.api_keys_file) if settings.api_keys_file else frozenset()
    monitor = app[MONITOR] = EngineMonitor(registry, settings.load_poll_interval_seconds)
    app[ADMISSION] = Admission(
        make_backend(settings),
        offers=monitor.offers,
        pools=registry.policies,
        lease_ttl_s=settings.lease_ttl_seconds,
    )
    app.cleanup_ctx.extend([pools_ctx, monitor_ctx, admission_ctx, upstream_ctx])
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, completions)
    return app
