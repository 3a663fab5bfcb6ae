"""The engine's part of a request's trace (see slotserve/tracing.py): ``queued``, ``prefill``
and ``decode`` spans under the request's server span, built when the request ends from the
timestamps the engine keeps anyway (``RequestMetrics``), never inside the step loop.

queued: arrival -> first scheduled (a slot). prefill: first scheduled -> first token. decode:
first token -> finished (a preempted sequence's recomputation falls in decode). With ``n`` > 1
each choice has its own three. Attributes carry ids, the model, token counts and finish reasons,
never prompt or output text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from slotserve.tracing import request_span

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.stats import RequestOutput

log = logging.getLogger(__name__)

Phase = tuple[str, float, float]  # name, start, end (engine clock, seconds)


def record_request_phases(
    request: web.Request,
    request_id: str,
    engine: AsyncEngine,
    outputs: Sequence[RequestOutput | None],
) -> None:
    """Add the phases of a finished request (its choices' final outputs) to its trace; a no-op
    with tracing off."""
    traced = request_span(request)
    if traced is None:
        return
    try:
        _record(*traced, request_id, engine, outputs)
    except Exception:  # tracing never fails a request that was served
        log.warning("could not record the trace of %s", request_id, exc_info=True)


def _record(
    tracer: Tracer,
    server_span: Span,
    request_id: str,
    engine: AsyncEngine,
    outputs: Sequence[RequestOutput | None],
) -> None:
    from opentelemetry import trace

    finals = [output for output in outputs if output is not None]
    server_span.set_attributes(
        {
            "gen_ai.response.id": request_id,
            "gen_ai.request.model": engine.model_name,
            # The prompt is counted once, as in the answer's usage.
            "gen_ai.usage.input_tokens": finals[0].num_prompt_tokens if finals else 0,
            "gen_ai.usage.output_tokens": sum(output.num_generated_tokens for output in finals),
            "gen_ai.response.finish_reasons": [output.finish_reason or "" for output in finals],
        }
    )
    to_wall_ns = _wall_clock_ns(engine.engine.clock)
    parent = trace.set_span_in_context(server_span)
    for index, output in enumerate(outputs):
        if output is None or output.metrics is None:
            continue  # ended before the engine had it (aborted while being added)
        attributes: dict[str, str | int] = {"slotserve.request_id": output.request_id}
        if len(outputs) > 1:
            attributes["slotserve.choice_index"] = index
        for name, start, end in phases(output):
            span = tracer.start_span(
                name, context=parent, start_time=to_wall_ns(start), attributes=attributes
            )
            if name == "prefill":
                span.set_attribute("gen_ai.usage.input_tokens", output.num_prompt_tokens)
            elif name == "decode":
                span.set_attribute("gen_ai.usage.output_tokens", output.num_generated_tokens)
                span.set_attribute("slotserve.finish_reason", output.finish_reason or "")
            span.end(end_time=to_wall_ns(end))


def phases(output: RequestOutput) -> list[Phase]:
    """The phases a finished sequence went through, on the engine's clock."""
    metrics = output.metrics
    if metrics is None:
        return []
    arrival = metrics.arrival_time
    scheduled = arrival + metrics.queue_time
    first_token = arrival + metrics.time_to_first_token
    finished = arrival + metrics.e2e_latency
    result: list[Phase] = [("queued", arrival, scheduled)]
    if output.num_generated_tokens > 0:
        result += [("prefill", scheduled, first_token), ("decode", first_token, finished)]
    elif scheduled < finished:  # got a slot, ended before its first token
        result.append(("prefill", scheduled, finished))
    return result


def _wall_clock_ns(clock: Callable[[], float]) -> Callable[[float], int]:
    """Engine-clock seconds (monotonic) -> epoch nanoseconds, anchored now."""
    offset_ns = time.time_ns() - int(clock() * 1e9)
    return lambda seconds: int(seconds * 1e9) + offset_ns
