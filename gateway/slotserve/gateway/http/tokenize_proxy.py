"""vLLM's tokenizer endpoints through the gateway: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, routed by model to a ready engine of its pool.

They take no slot on the engine (no forward pass: the tokenizer only), so they skip admission:
a request goes straight to the least loaded ready engine of the pool, and to the next one if
that engine cannot be reached. The model is the body's ``model`` (the query's ``model`` for
``/tokenizer_info``); a client that names none (lm-evaluation-harness's remote tokenizer does
not) is served when the gateway has exactly one pool.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from slotserve.gateway.http.app_keys import MONITOR, PROXY, REGISTRY
from slotserve.gateway.http.completions import parse_json_object
from slotserve.gateway.http.errors import error_response

TOKENIZER_PATHS = ("/tokenize", "/detokenize")
TOKENIZER_INFO_PATH = "/tokenizer_info"


async def tokenizer_post(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    try:
        payload = parse_json_object(body)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_json")
    model = payload.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        return error_response(400, "'model' must be a string", "invalid_value", param="model")
    return await _forward(request, model, body)


async def tokenizer_info(request: web.Request) -> web.StreamResponse:
    return await _forward(request, request.query.get("model"), None)


async def _forward(request: web.Request, model: str | None, body: bytes | None) -> web.Response:
    registry = request.app[REGISTRY]
    if model is None:
        names = sorted(registry.pools)
        if len(names) != 1:
            return error_response(
                400,
                f"'model' is required: this gateway serves {len(names)} models",
                "missing_model",
                param="model",
            )
        model = names[0]
    if registry.get(model) is None:
        return error_response(
            404, f"model {model!r} is not served here", "model_not_found", param="model"
        )
    offers = sorted(request.app[MONITOR].offers(model), key=lambda offer: offer.load_score)
    if not offers:
        return error_response(
            503, f"no engine of pool {model!r} is ready", "no_ready_endpoint", retry_after_s=1
        )
    session = request.app[PROXY].session
    headers = {"Content-Type": "application/json"}
    failure = ""
    for offer in offers:
        url = f"{offer.url}{request.path}"
        try:
            if body is None:
                upstream = await session.get(url)
            else:
                upstream = await session.post(url, data=body, headers=headers)
            async with upstream:
                data = await upstream.read()
                return web.Response(
                    status=upstream.status,
                    body=data,
                    content_type=upstream.content_type,
                    charset=upstream.charset,
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            failure = str(exc) or type(exc).__name__
    return error_response(
        502, f"no engine of pool {model!r} answered: {failure}", "upstream_failed"
    )
