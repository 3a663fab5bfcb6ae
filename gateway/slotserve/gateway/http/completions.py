"""``POST /v1/completions`` and ``/v1/chat/completions``: from the client's request to a lease.

The body and headers are checked here (400/403/404 before anything queues), the request waits
for a slot in admission (429/503 with ``Retry-After``), and the lease goes to the proxy, which
streams the engine's answer back and gives the slot up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from slotserve.contracts.headers import DEADLINE_MS_HEADER, PRIORITY_HEADER
from slotserve.gateway.admission.tenants import CACHE_SALT, DEFAULT, DEFAULT_TENANT, TENANT
from slotserve.gateway.admission.types import AdmissionError, NoEngineFitsError, PoolPolicy
from slotserve.gateway.http.app_keys import (
    ADMISSION,
    API_KEYS,
    COLD_STARTS,
    METRICS,
    MONITOR,
    PROXY,
    REGISTRY,
    SETTINGS,
    WINDOW,
)
from slotserve.gateway.http.errors import error_response
from slotserve.gateway.http.proxy import proxy_request
from slotserve.gateway.http.route_hints import SessionKeyError, route_of
from slotserve.gateway.http.tracing import traced_admission
from slotserve.gateway.pools.config import Pool
from slotserve.gateway.pools.routing import EndpointOffer, most_slots


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


# The engine's own bound on ``n`` (engine/http/choices.py MAX_CHOICES): more is a 400 there.
MAX_CHOICES = 128


def slots_bound(pool: Pool, offers: Sequence[EndpointOffer]) -> int:
    """The most slots one request may ask for: the engine's limit, and the slots of the
    pool's biggest ready engine, or at zero (none ready) the pool's ``maxBatchSize``, the slots
    it starts its engines with. Every request is bounded, so none can ask for more than any
    engine could ever hold and wait at the head of the queue for good."""
    return min(MAX_CHOICES, most_slots(offers) or pool.batching.max_batch_size)


def num_prompts(payload: dict[str, Any]) -> int:
    """Prompts in a request: a ``prompt`` list of strings or of token-id lists is a batch (one
    sequence each in the engine, as its ``CompletionRequest.prompts`` reads it); anything else
    is one."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def requested_slots(payload: dict[str, Any]) -> int:
    """The engine slots a request takes: one per prompt and choice (P prompts x ``n``), as the
    engine runs each as a sequence. A malformed ``n`` counts one: the engine refuses it (400
    naming ``n``) without taking a slot."""
    n = payload.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return choices * num_prompts(payload)


async def completions(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    m = request.app[METRICS]
    body = await request.read()  # read (within its timeout and budget) by request_limits.py
    try:
        payload = parse_json_object(body)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_json")
    # A waiting request keeps its raw bytes (for the engine) and these two, never the parsed
    # tree, which can be many times its body's size.
    model, slots = payload.get("model"), requested_slots(payload)
    field = "prompt" if num_prompts(payload) > 1 else "n"  # the one to name when over the bound
    if not isinstance(model, str) or not model:
        return error_response(400, "'model' (a string) is required", "missing_model", param="model")
    pool = request.app[REGISTRY].get(model)
    if pool is None:
        return error_response(
            404, f"model {model!r} is not served here", "model_not_found", param="model"
        )
    try:
        chat = request.path.endswith("/chat/completions")
        salt = request.get(CACHE_SALT, DEFAULT_TENANT)
        route = route_of(
            pool.routing, request.app[MONITOR], model, chat, request.headers, payload, salt
        )
    except SessionKeyError as exc:
        return error_response(400, str(exc), "invalid_header")
    del payload
    policy = pool.policy
    try:
        priority = _header_int(request, PRIORITY_HEADER, 1, policy.priority_levels)
        deadline_ms = _header_int(request, DEADLINE_MS_HEADER, 1, 3_600_000)
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
    monitor = request.app[MONITOR]
    offers = monitor.offers(model)
    # No ready engine: held in the queue while one starts (cold_start.py), unless turned off.
    held = not offers
    if held and not settings.hold_at_zero:
        m.rejected.labels(model, "no_ready_endpoint").inc()
        if window is not None:
            window.rejected(model, "no_ready_endpoint")
        return error_response(
            503, f"no engine of pool {model!r} is ready", "no_ready_endpoint", retry_after_s=1
        )
    bound = slots_bound(pool, offers)
    if slots > bound:
        # Refused before queueing, as the engine would: no endpoint could ever hold it.
        m.rejected.labels(model, "invalid_value").inc()
        what = "every ready engine" if offers else "the engines it starts (maxBatchSize)"
        asked = f"'n' ({slots})" if field == "n" else f"'prompt' x 'n' ({slots} sequences)"
        return error_response(
            400,
            f"{asked} exceeds the slots of {what} of pool {model!r} "
            f"(at most {bound}): each prompt's choice takes one",
            "invalid_value",
            param=field,
        )
    tenant = request.get(TENANT, DEFAULT)
    try:
        acquire = admission.acquire(
            policy,
            priority,
            timeout_s,
            demote_after_s=wait.demote_after_s,
            slots=slots,
            tenant=tenant.name,
            weight=tenant.weight,
            route=route,
        )
        if held:
            acquire = request.app[COLD_STARTS].held(
                pool, acquire, waited_s=timeout_s, at_zero=lambda: not monitor.offers(model)
            )
        lease = await traced_admission(request, model, acquire)
    except AdmissionError as exc:
        m.rejected.labels(model, exc.code).inc()
        if window is not None:
            window.rejected(model, exc.code)
        if isinstance(exc, NoEngineFitsError):  # the engines changed while it waited
            return error_response(exc.status, exc.message, exc.code, param="n")
        return error_response(exc.status, exc.message, exc.code, retry_after_s=exc.retry_after_s)
    m.admitted.labels(model).inc()
    m.queue_wait.labels(model).observe(lease.queue_wait_s)
    m.tenant_queue_wait.labels(model, tenant.name).observe(lease.queue_wait_s)
    if window is not None:
        window.admitted(model, lease.queue_wait_s, tenant.name)
    if route is not None and route.keys:
        depth = request.app[MONITOR].matched_depth(lease.endpoint, route.keys)
        m.prefix_routed.labels(model, "hit" if depth else "miss").inc()
        m.prefix_keys_matched.labels(model).inc(depth)
        if window is not None:
            window.prefix_routed(model, hit=depth > 0)
    try:
        return await proxy_request(request, request.app[PROXY], lease, body, deadline)
    except ConnectionResetError:
        return web.Response(status=499)  # client went away; nothing to send
