"""OpenAI-shaped error responses."""

from __future__ import annotations

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
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
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error"),
            "code": code,
            "param": param,
        }
    }
    return web.json_response(body, status=status, headers=headers)
