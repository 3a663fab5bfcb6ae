"""The OpenAI endpoints' replies: a request's outputs as one JSON body or as server-sent events.

A request that ends without its answer says who is at fault: the engine stopped or broke (503,
another replica can serve it) or the request's own sequence failed (500). A stream that fails
after its first byte ends with an SSE error event and no ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from aiohttp import web

from slotserve.engine.http.http_state import ApiError, ServerState, slot_headers
from slotserve.engine.http.openai_format import DONE_EVENT, ChoiceOutput, OutputFormat, sse_event

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.logprobs import TokenLogprobs
    from slotserve.engine.core.stats import RequestOutput
    from slotserve.engine.http.choices import Choices

log = logging.getLogger(__name__)


def _aborted() -> ApiError:
    return ApiError(
        503,
        "the request was aborted: the engine is shutting down",
        type_="server_error",
        code="aborted",
    )


def _ended_early(output: RequestOutput) -> ApiError:
    """Why a request ended without its answer, saying who is at fault: the engine stopped or
    broke (503: another replica can serve it), or this request's own sequence failed (500)."""
    error = output.error
    if output.finish_reason != "error" or error is None:
        return _aborted()
    if error.is_engine_failure:
        return ApiError(
            503,
            error.message,
            type_="service_unavailable_error",
            code="engine_failure",
            headers={"Retry-After": "1"},
        )
    return ApiError(500, error.message, type_="server_error", code=error.reason)


async def collect(
    state: ServerState,
    engine: AsyncEngine,
    choices: Choices,
    fmt: OutputFormat,
    wants_logprobs: bool,
) -> web.Response:
    """Wait for every choice to finish, then answer with one JSON body."""
    n = len(choices.streams)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprobs] | None] = [[] if wants_logprobs else None for _ in range(n)]
    finals: list[RequestOutput | None] = [None] * n
    async for index, output in choices.outputs():
        fmt.observe(index, output)
        texts[index].append(output.text)
        if (entries := logprobs[index]) is not None and output.logprobs:
            entries.extend(output.logprobs)
        if output.finished:
            choices.record(state, index, output)
            if output.finish_reason in ("abort", "error"):
                raise _ended_early(output)
            finals[index] = output
    done = [final for final in finals if final is not None]
    if len(done) < n:
        raise _aborted()  # a stream always ends with a finished output; never hang the client
    body = fmt.response(
        [
            ChoiceOutput("".join(text), final.finish_reason, entries)
            for text, final, entries in zip(texts, done, logprobs, strict=True)
        ],
        choices.counts(done),
    )
    return web.json_response(text=body, headers=slot_headers(engine.stats()))


async def stream_sse(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    choices: Choices,
    fmt: OutputFormat,
    include_usage: bool,
) -> web.StreamResponse:
    """Send each output as an SSE chunk as it comes, then the usage (if asked) and [DONE]."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **slot_headers(engine.stats()),
        }
    )
    await response.prepare(request)
    try:
        for index in range(len(choices.streams)):
            if first := fmt.first_chunk(index):
                await response.write(first)
        async for index, output in choices.outputs():
            fmt.observe(index, output)
            if not output.finished:
                if output.text or output.logprobs or fmt.has_pending(index):
                    await response.write(fmt.chunk(output.text, None, output.logprobs, index))
                continue
            choices.record(state, index, output)
            if output.finish_reason in ("abort", "error"):
                # An "error" event (OpenAI clients raise on it) and no [DONE]: nobody may take
                # a cut answer for a whole one.
                await response.write(sse_event(_ended_early(output).body))
                await response.write_eof()
                return response
            await response.write(
                fmt.chunk(output.text, output.finish_reason, output.logprobs, index)
            )
        if include_usage:
            await response.write(fmt.usage_chunk(choices.counts(choices.finals())))
        await response.write(DONE_EVENT)
        await response.write_eof()
    except ConnectionError:
        log.debug("client of %s disconnected", fmt.request_id)
    except Exception:
        # The status line is sent: the error can only travel as an event.
        log.exception("stream %s failed", fmt.request_id)
        error = ApiError(500, "internal error while streaming", type_="server_error")
        with contextlib.suppress(Exception):
            await response.write(sse_event(error.body))
    return response
