"""What a request may cost the replica before any handler sees it: bytes, time, JSON size.

``request_limits_middleware`` runs for every POST that matched a route, after authentication:
it reserves the body's bytes in the replica's ``MemoryBudget`` (503 + ``Retry-After`` past it),
reads the body within ``body_read_timeout_seconds`` (408: a slow-body client does not hold a
handler for good), and bounds the JSON on the raw bytes (``check_json_bounds``: 400 before any
tree is built; a 1 MiB body of ``[{},{},...]`` parses to ~24 MiB of objects in ~50-90 ms). The
reservation is released when the handler returns, after a stream's last byte; handlers grow it
while they buffer an answer (``proxy.py``).
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import Awaitable, Callable
from itertools import accumulate

from aiohttp import web

from slotserve.gateway.http.app_keys import BUDGET, METRICS, SETTINGS
from slotserve.gateway.http.errors import error_response
from slotserve.gateway.http.memory_budget import REQUEST_OVERHEAD_BYTES, RESERVATION

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A JSON string (escapes included), in one pass of the regex engine.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]+")
_WHITESPACE = re.compile(rb"[ \t\r\n]+")
_DEPTH_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes


def check_json_bounds(body: bytes, max_nodes: int, max_depth: int) -> None:
    """Raise ValueError when the JSON in ``body`` has more than ``max_nodes`` values or nests
    deeper than ``max_depth``, read from the raw bytes (strings skipped) without parsing.

    Values are counted by what introduces them (a non-empty array's ``[``, ``,``, ``:``): a token-id
    prompt counts one per id, an object one per member. Costs a few ms at 1 MiB; bodies with few
    brackets, nearly all, skip the scan.
    """
    num_opens = body.count(b"[") + body.count(b"{")
    if num_opens <= max_depth and num_opens + body.count(b",") + body.count(b":") < max_nodes:
        return
    bare = _WHITESPACE.sub(b"", _STRING.sub(b'""', body))
    # Each value but the outermost follows a non-empty array's "[", a "," or a ":".
    num_nodes = 1 + bare.count(b"[") - bare.count(b"[]") + bare.count(b",") + bare.count(b":")
    if num_nodes > max_nodes:
        raise ValueError(f"request body's JSON has too many values (more than {max_nodes})")
    steps = _NOT_A_BRACKET.sub(b"", bare).translate(_DEPTH_STEPS)
    if steps and max(accumulate(array("b", steps))) > max_depth:
        raise ValueError(f"request body's JSON is nested too deeply (more than {max_depth} levels)")


@web.middleware
async def request_limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or request.match_info.http_exception is not None:
        return await handler(request)
    settings = request.app[SETTINGS]
    budget = request.app[BUDGET]
    expected = min(
        request.content_length
        if request.content_length is not None
        else settings.max_request_body_bytes,
        settings.max_request_body_bytes,
    )
    reservation = budget.reserve(expected + REQUEST_OVERHEAD_BYTES)
    if reservation is None:
        request.app[METRICS].rejected.labels("", "memory_budget").inc()
        return error_response(
            503,
            "this gateway replica holds as many request bytes as its memory budget allows "
            f"({budget.limit_bytes} bytes); try again shortly",
            "memory_budget_exceeded",
            retry_after_s=1,
        )
    try:
        try:
            body = await asyncio.wait_for(request.read(), settings.body_read_timeout_seconds)
        except TimeoutError:
            return error_response(
                408,
                f"the request body did not arrive within {settings.body_read_timeout_seconds:g} s",
                "body_timeout",
            )
        reservation.resize(len(body) + REQUEST_OVERHEAD_BYTES)
        try:
            check_json_bounds(body, settings.max_json_nodes, settings.max_json_depth)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_json")
        request[RESERVATION] = reservation
        return await handler(request)
    finally:
        reservation.release()
