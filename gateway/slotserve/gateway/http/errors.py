"""OpenAI-shaped error responses."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    504: "upstream_error",
    503: "service_unavailable",
}


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    """``{"error": {"message", "type", "code", "param"}}`` with a fitting status."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(
        error_body(status, message, code, param), status=status, headers=headers
    )


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "code": code,
            "param": param,
        }
    }


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The error as the last event of a stream whose status line (200) is already sent: what
    OpenAI sends, and what the engine sends when a stream fails mid-way (then no [DONE])."""
    return f"data: {json.dumps(error_body(status, message, code))}\n\n".encode()
