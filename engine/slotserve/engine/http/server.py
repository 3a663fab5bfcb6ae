"""The engine's HTTP server: OpenAI API, load report, health, metrics and graceful drain.

Lifecycle (``serve``): the listener opens at once, so ``/health`` answers while the model loads
in a background thread and ``/ready`` is 503 until it is loaded and the step loop runs. On SIGTERM
``/ready`` and new requests turn 503, in-flight requests finish (at most
``drain_timeout_seconds``; then they are aborted), the engine shuts down and the process exits 0.
A second SIGTERM/SIGINT skips the wait. A model that fails to load exits 1.

A broken runner (a step raised: see ``AsyncEngine``) fails ``/health`` and ``/ready`` and
answers 503 to new requests; the process keeps running so that ``/metrics`` can still be read,
and Kubernetes' liveness probe restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from slotserve.contracts.engine_load import MAX_ROW_IDLE_MS, EngineLoadReport
from slotserve.engine.core.errors import UnsupportedSettingError
from slotserve.engine.http.http_state import (
    STATE,
    ApiError,
    ServerState,
    accepting_engine,
    broken_engine_error,
    loaded_engine,
    slot_headers,
)
from slotserve.engine.http.openai_routes import chat_completions, completions, models
from slotserve.engine.http.responses_routes import responses
from slotserve.engine.http.tokenize_routes import detokenize, tokenize, tokenizer_info
from slotserve.engine.settings import EngineSettings
from slotserve.models.resolve import resolve_model
from slotserve.tracing import install_tracing, shutdown_provider

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import TracerProvider

    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.stats import EngineStats

log = logging.getLogger(__name__)

# Requests still running when the drain deadline passes are aborted; their handlers then get
# this long to send the final bytes before the server closes.
ABORT_GRACE_SECONDS = 5.0
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
T = TypeVar("T")


def create_app(
    engine_or_settings: AsyncEngine | EngineSettings,
    tracer_provider: TracerProvider | None = None,
) -> web.Application:
    """The engine app. Given settings, it loads the model itself (in a thread, after start-up);
    given a loaded ``AsyncEngine``, it starts it. Either way the app shuts the engine down.
    With a ``tracer_provider`` the OpenAI requests are traced (slotserve/tracing.py)."""
    if isinstance(engine_or_settings, EngineSettings):
        settings, preloaded = engine_or_settings, None
    else:
        settings, preloaded = engine_or_settings.settings, engine_or_settings
    app = web.Application(
        client_max_size=settings.max_request_body_bytes, middlewares=[_errors_as_openai]
    )
    app[STATE] = ServerState(settings=settings, preloaded=preloaded)
    app.cleanup_ctx.append(_engine_lifecycle)
    app.router.add_post(COMPLETION_PATHS[0], completions)
    app.router.add_post(COMPLETION_PATHS[1], chat_completions)
    app.router.add_post(COMPLETION_PATHS[2], responses)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/load", _load)
    app.router.add_get("/metrics", _metrics)
    install_tracing(app, tracer_provider, "slotserve.engine", COMPLETION_PATHS)
    return app


# ---------------------------------------------------------------------------------------------
# Lifecycle


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    loading = asyncio.create_task(_load_and_start(state))
    yield
    if not loading.done():
        loading.cancel()  # the loader thread is a daemon: it dies with the process
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await loading
    if state.engine is not None:
        await state.engine.shutdown()


async def _load_and_start(state: ServerState) -> None:
    try:
        engine = state.preloaded
        if engine is None:
            # A wrong model name or path fails here in milliseconds, before torch is imported.
            await _in_daemon_thread(resolve_model, state.settings.model)
            from slotserve.engine.core.async_engine import AsyncEngine

            log.info("loading model %s", state.settings.model)
            engine = await _in_daemon_thread(AsyncEngine.load, state.settings)
            # This process serves this one engine: its model's millions of Python objects
            # live as long as the process, so they leave the collector's sight, and a full
            # collection during a step (the bf16 prefill's callbacks allocate) no longer walks
            # them, as vLLM does after loading. Not for a preloaded engine (tests, embedders).
            gc.freeze()
        await engine.start()
    except UnsupportedSettingError as error:
        # A setting this model or machine cannot run: one clear line, no traceback, exit 2.
        log.error("cannot start: %s", error)
        state.load_error = str(error)
        state.fatal_exit_code = 2
        state.fatal.set()
        return
    except Exception as error:
        log.exception("the model failed to load")
        state.load_error = f"{type(error).__name__}: {error}"
        state.fatal.set()
        return
    state.engine = engine
    log.info(
        "serving %s: %d slots, %d KV rows, max_model_len %d, policy %s",
        engine.model_name,
        engine.num_slots,
        engine.engine.kv_cache.num_rows,
        engine.max_model_len,
        state.settings.policy,
    )


async def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a daemon thread: unlike ``to_thread`` it never delays process exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as error:
            loop.call_soon_threadsafe(settle, future.set_exception, error)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=run, name="slotserve-load", daemon=True).start()
    return await future


async def drain(state: ServerState, timeout: float, force: asyncio.Event) -> None:
    """Refuse new work, let in-flight requests finish (or abort them after ``timeout``)."""
    state.draining = True
    log.info("draining: %d requests in flight, up to %.0f s", len(state.in_flight), timeout)
    await _first_of(state.idle.wait(), force.wait(), timeout=timeout)
    if state.in_flight and state.engine is not None:
        log.warning("aborting %d requests still running", len(state.in_flight))
        for request_id in list(state.in_flight):
            state.engine.abort(request_id)
        await _first_of(state.idle.wait(), timeout=ABORT_GRACE_SECONDS)


async def _first_of(*waits: Awaitable[Any], timeout: float | None) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def serve(settings: EngineSettings, tracer_provider: SdkTracerProvider | None = None) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after draining) or a failed model load (exit 1; 2
    when the settings cannot run with this model or machine)."""
    app = create_app(settings, tracer_provider)
    state = app[STATE]
    access_log = log if log.isEnabledFor(logging.DEBUG) else None
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # sequence even while it is still waiting for its first token.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=access_log, shutdown_timeout=2.0
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, error)
        await runner.cleanup()
        return 1
    log.info("listening on http://%s:%d", settings.host, settings.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await _first_of(stop.wait(), state.fatal.wait(), timeout=None)
    exit_code = state.fatal_exit_code if state.fatal.is_set() else 0
    if exit_code == 0:
        stop.clear()  # a second signal skips the rest of the drain
        await drain(state, settings.drain_timeout_seconds, force=stop)
    await runner.cleanup()
    await asyncio.to_thread(shutdown_provider, tracer_provider)  # the last spans
    log.info("stopped (exit %d)", exit_code)
    return exit_code


# ---------------------------------------------------------------------------------------------
# Probes, load report, metrics


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.load_error is not None:
        raise ApiError(503, f"model failed to load: {state.load_error}", type_="server_error")
    if state.engine is not None and state.engine.failure is not None:
        # Not alive: Kubernetes restarts the pod (the process stays up so /metrics is scraped).
        raise broken_engine_error(state.engine.failure)
    return web.json_response({"status": "ok", "loaded": state.engine is not None})


async def _ready(request: web.Request) -> web.Response:
    accepting_engine(request.app[STATE])
    return web.json_response({"status": "ready"})


async def _load(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = loaded_engine(state)
    stats = engine.stats()
    empty_rows = sum(rid is None for rid in stats.row_request_ids)
    report = EngineLoadReport(
        model=engine.model_name,
        policy=stats.policy,
        slots_total=stats.num_slots_total,
        slots_free=stats.num_slots_free,
        running=stats.num_running,
        waiting=stats.num_waiting,
        kv_cache_usage=stats.kv_cache_usage,
        draining=state.draining,
        mean_request_seconds=round(state.metrics.mean_request_seconds, 6),
        calibrations=[record.as_dict() for record in stats.calibrations],
        kv_cache_dtype=stats.kv_cache_dtype,
        max_batched_tokens=stats.max_batched_tokens,
        prefix_keys=state.prefix_rows.report(stats.row_request_ids),
        prefix_cache_rows=stats.num_kv_rows,
        prefix_rows_free=max(0, empty_rows - stats.num_waiting),
        prefix_row_idle_ms=next_eviction_idle_ms(stats, empty_rows),
    )
    return web.json_response(report.model_dump(mode="json"), headers=slot_headers(stats))


def next_eviction_idle_ms(stats: EngineStats, empty_rows: int) -> int:
    """How long the row a new prefix would take next has sat unused: the waiting requests take
    the empty rows, then the least recently used ones, first (``SlotPrefixCache.choose``)."""
    if empty_rows > stats.num_waiting:
        return 0  # an empty row is next: prefix_rows_free says so
    idle_since = sorted(at for at in stats.row_idle_since if at is not None)
    skip = stats.num_waiting - empty_rows
    if skip >= len(idle_since):
        return 0
    idle_ms = (time.monotonic() - idle_since[skip]) * 1000
    return min(MAX_ROW_IDLE_MS, max(0, int(idle_ms)))


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


# ---------------------------------------------------------------------------------------------
# Errors


@web.middleware
async def _errors_as_openai(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        response = error.response()
        engine = request.app[STATE].engine
        if engine is not None and request.path.startswith("/v1/"):
            # The gateway reads capacity from every answer, refusals included.
            for name, value in slot_headers(engine.stats()).items():
                response.headers.setdefault(name, value)
        return response
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return ApiError(error.status, f"{error.reason}: {request.method} {request.path}").response()
    except Exception:
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return ApiError(500, "internal server error", type_="server_error").response()
