"""The gateway's aiohttp application: ``create_app(settings)``, its middleware, probes and
resources (the completion endpoints are ``completions.py``; the app's keys ``app_keys.py``).

Start-up order (cleanup contexts): pools -> engine monitor -> admission -> upstream session.
Shutdown runs them in reverse: stop taking requests, close the upstream session, stop admission
(leases not released by then expire after the lease TTL), stop polling engines, stop watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from slotserve.gateway.admission.backends.memory import InProcessBackend, InProcessHub
from slotserve.gateway.admission.front import Admission
from slotserve.gateway.admission.types import AdmissionBackend
from slotserve.gateway.admission.window import AdmissionWindowWriter
from slotserve.gateway.http.api_keys import ApiKeys
from slotserve.gateway.http.app_keys import (
    ADMISSION,
    API_KEYS,
    BUDGET,
    COLD_STARTS,
    METRICS,
    MONITOR,
    PROXY,
    REGISTRY,
    SETTINGS,
    WINDOW,
)
from slotserve.gateway.http.completions import completions
from slotserve.gateway.http.errors import error_response
from slotserve.gateway.http.memory_budget import MemoryBudget, default_budget_bytes
from slotserve.gateway.http.metrics import GatewayMetrics
from slotserve.gateway.http.proxy import ProxyContext
from slotserve.gateway.http.request_limits import request_limits_middleware
from slotserve.gateway.http.tenant_gate import install_tenants
from slotserve.gateway.http.tokenize_proxy import (
    TOKENIZER_INFO_PATH,
    TOKENIZER_PATHS,
    tokenizer_info,
    tokenizer_post,
)
from slotserve.gateway.pools.cold_start import ColdStarts
from slotserve.gateway.pools.config import PoolRegistry, load_pools, watch_pool_file
from slotserve.gateway.pools.discovery import PoolCatalog, start_kubernetes_watch
from slotserve.gateway.pools.engines import EngineMonitor
from slotserve.gateway.settings import GatewaySettings
from slotserve.tracing import install_tracing

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
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


# -- probes and the model list ------------------------------------------------------------------


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    admission = request.app[ADMISSION]
    monitor = request.app[MONITOR]
    registry = request.app[REGISTRY]
    # Ready once the first full list of pools is in and all its endpoints were polled once.
    synced_version = registry.synced_version
    is_ready = synced_version is not None and monitor.polled_version >= synced_version
    keys = request.app[API_KEYS]
    if keys.enabled and not keys.accepts(request.headers.get("Authorization", "")):
        # Probes carry no key: they get the status alone, never the pools and their engines.
        return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)
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
        for url, size in request.app[MONITOR].index_sizes(name).items():
            m.prefix_index_keys.labels(name, url).set(size)
    m.backend_up.set(1 if admission.backend_ok else 0)
    m.held_bytes.set(request.app[BUDGET].held_bytes)
    return web.Response(
        body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def list_models(request: web.Request) -> web.Response:
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "slotserve"}
        for name in sorted(request.app[REGISTRY].pools)
    ]
    return web.json_response({"object": "list", "data": data})


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
        allowed = tuple((glob, frozenset(ns)) for glob, ns in settings.model_namespaces.items())
        catalog = PoolCatalog(
            registry, sources, lambda model: conflicts.labels(model).inc(), allowed
        )
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
        from slotserve.gateway.admission.backends.redis import RedisBackend

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
        app[ADMISSION],
        app[MONITOR],
        session,
        app[METRICS],
        settings.max_attempts,
        settings.max_upstream_answer_bytes,
    )
    yield
    await session.close()


def create_app(
    settings: GatewaySettings, tracer_provider: TracerProvider | None = None
) -> web.Application:
    """Build the gateway app; resources start with the app and stop with it. With a
    ``tracer_provider`` the completion requests are traced (slotserve/tracing.py)."""
    app = web.Application(
        middlewares=[auth_middleware, request_limits_middleware],
        client_max_size=settings.max_request_body_bytes,
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
        deadline_refusal=settings.deadline_refusal,
    )
    app[COLD_STARTS] = ColdStarts(settings.cold_start_seconds)
    budget_bytes = settings.memory_budget_bytes or default_budget_bytes(
        settings.memory_budget_fraction
    )
    app[BUDGET] = MemoryBudget(budget_bytes)
    app[METRICS].memory_budget.set(budget_bytes)
    app[WINDOW] = None
    if settings.redis_url:
        from slotserve.gateway.admission.backends.redis import make_client

        app[WINDOW] = AdmissionWindowWriter(make_client(settings.redis_url), settings.redis_prefix)
    app.cleanup_ctx.extend(
        [api_keys_ctx, pools_ctx, monitor_ctx, admission_ctx, admission_window_ctx, upstream_ctx]
    )
    install_tenants(app, settings, app[API_KEYS], app[METRICS])  # quotas, cache salt
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, completions)
    # vLLM's tokenizer endpoints: no slot taken, so no admission (tokenize_proxy.py).
    for path in TOKENIZER_PATHS:
        app.router.add_post(path, tokenizer_post)
    app.router.add_get(TOKENIZER_INFO_PATH, tokenizer_info)
    install_tracing(app, tracer_provider, "slotserve.gateway", COMPLETION_PATHS)
    return app
