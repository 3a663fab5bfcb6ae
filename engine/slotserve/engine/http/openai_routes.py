"""The OpenAI endpoints: completions and chat completions (plain and SSE) and the model list.

A request is parsed strictly, checked against the served model, turned into token ids (chat
through the tokenizer's template) and handed to the engine; its outputs are written as one JSON
body or as server-sent events. Whatever ends the handler early (client gone, error) aborts the
sequence, so its slot is free at the next engine step.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from slotserve.engine.core.errors import EngineNotRunningError, InvalidRequestError, QueueFullError
from slotserve.engine.core.generation_defaults import GenerationDefaults
from slotserve.engine.core.params import SamplingParams
from slotserve.engine.core.structured import GrammarError, check_requested_grammar
from slotserve.engine.core.tokenize import PromptTooLongError, TokenizerUnavailableError
from slotserve.engine.http.choices import Choices
from slotserve.engine.http.http_state import (
    STATE,
    ApiError,
    ServerState,
    accepting_engine,
    loaded_engine,
    slot_headers,
)
from slotserve.engine.http.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    describe_validation_error,
)
from slotserve.engine.http.openai_format import (
    DONE_EVENT,
    ChatFormat,
    ChoiceOutput,
    CompletionFormat,
    OutputFormat,
    sse_event,
)
from slotserve.engine.http.openai_responses import ModelCard, ModelList
from slotserve.engine.http.tool_calls import check_tool_schemas, plan_tools
from slotserve.engine.http.tool_format import ToolChatFormat
from slotserve.engine.http.tracing import record_request_phases

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine
    from slotserve.engine.core.logprobs import TokenLogprobs
    from slotserve.engine.core.stats import RequestOutput

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=BaseModel)


# ---------------------------------------------------------------------------------------------
# Completions


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _admit(state)
    body = await _parse_body(request, CompletionRequest, state)
    _check_model(engine, body.model, state)
    prompt = await _encode(engine, state, body.single_prompt)
    max_tokens = body.requested_max_tokens()
    if "max_tokens" not in body.model_fields_set:
        max_tokens = engine.engine.generation_defaults.max_tokens or max_tokens
    if max_tokens is None:  # explicit null: as many tokens as fit
        max_tokens = _room_after(engine, len(prompt))
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", engine.model_name)
    return await _generate(request, state, engine, body, prompt, max_tokens, fmt)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _admit(state)
    body = await _parse_body(request, ChatCompletionRequest, state)
    _check_model(engine, body.model, state)
    try:
        tools = plan_tools(
            body, state.settings.tool_call_parser, engine.engine.tokenizer.chat_template
        )
        await check_tool_schemas(engine.engine.grammars, tools)
        messages, template_tools = tools.template_input(body.template_messages())
        prompt = await engine.prompts.encode_chat(messages, template_tools)
    except InvalidRequestError as error:
        raise _invalid(error, state) from error
    except TokenizerUnavailableError as error:
        raise _tokenizer_unavailable(error) from error
    room = _room_after(engine, len(prompt))
    default_max_tokens = engine.engine.generation_defaults.max_tokens
    max_tokens = body.requested_max_tokens() or min(default_max_tokens or room, room)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    fmt = (
        ToolChatFormat(request_id, engine.model_name, tools)
        if tools.parses
        else ChatFormat(request_id, engine.model_name)
    )
    return await _generate(request, state, engine, body, prompt, max_tokens, fmt, tools.grammar())


def _room_after(engine: AsyncEngine, num_prompt_tokens: int) -> int:
    """Default max_tokens: whatever fits after the prompt (in the model and in the KV cache)."""
    capacity = min(engine.max_model_len, engine.stats().kv_cache_tokens_total)
    return max(1, capacity - num_prompt_tokens)


def _admit(state: ServerState) -> AsyncEngine:
    try:
        return accepting_engine(state)
    except ApiError as error:
        state.metrics.reject(error.body.error.code or "unavailable")
        raise


async def _encode(engine: AsyncEngine, state: ServerState, prompt: str | list[int]) -> list[int]:
    """A completion prompt as token ids: tokenized off the event loop, after a cheap length
    bound (see tokenize.py); the engine validates the ids themselves."""
    try:
        if isinstance(prompt, list):
            engine.prompts.check_num_tokens(len(prompt), "prompt")
            return prompt
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return await engine.prompts.encode(prompt)
    except InvalidRequestError as error:
        raise _invalid(error, state) from error
    except TokenizerUnavailableError as error:
        raise _tokenizer_unavailable(error) from error


def _tokenizer_unavailable(error: TokenizerUnavailableError) -> ApiError:
    return ApiError(
        503,
        str(error),
        type_="service_unavailable_error",
        code="tokenizer_unavailable",
        headers={"Retry-After": "1"},
    )


def _invalid(error: InvalidRequestError, state: ServerState) -> ApiError:
    state.metrics.reject("invalid")
    code = "context_length_exceeded" if isinstance(error, PromptTooLongError) else "invalid_value"
    return ApiError(400, error.message, param=error.param, code=code)


async def _parse_body(request: web.Request, model: type[RequestT], state: ServerState) -> RequestT:
    limit = state.settings.max_request_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, state)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as error:
        raise _too_large(limit, state) from error
    except web.RequestPayloadError as error:  # e.g. "Content-Encoding: gzip" that is not gzip
        state.metrics.reject("invalid")
        # The connection's parser is left mid-body: a next request on it would be misread.
        raise ApiError(
            400,
            f"the request body could not be read: {error}",
            code="invalid_body",
            headers={"Connection": "close"},
        ) from error
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        state.metrics.reject("invalid")
        message, param, code = describe_validation_error(error)
        raise ApiError(400, message, param=param, code=code) from error


def _too_large(limit: int, state: ServerState) -> ApiError:
    state.metrics.reject("too_large")
    return ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")


def _check_model(engine: AsyncEngine, name: str, state: ServerState) -> None:
    if name != engine.model_name:
        state.metrics.reject("unknown_model")
        raise ApiError(
            404,
            f"The model '{name}' does not exist; this engine serves '{engine.model_name}'",
            param="model",
            code="model_not_found",
        )


def _sampling_params(
    body: SamplingRequest, max_tokens: int, defaults: GenerationDefaults
) -> SamplingParams:
    chosen = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k_or_none,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
    }
    for name, value in defaults.as_dict().items():
        # The model's recommendation replaces OpenAI's default, never a value the client sent.
        if name in chosen and name not in body.model_fields_set:
            chosen[name] = value
    if body.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"'min_tokens' ({body.min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            **chosen,
            seed=body.seed,
            stop=body.stop_list,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=body.num_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=body.logit_bias_ids,
            min_tokens=body.min_tokens,
        )
    except ValidationError as error:
        message, param, code = describe_validation_error(error)
        raise ApiError(400, message, param=param, code=code) from error


async def _generate(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    body: SamplingRequest,
    prompt: str | list[int],
    max_tokens: int,
    fmt: OutputFormat,
    tool_grammar: tuple[str, str] | None = None,
) -> web.StreamResponse:
    params = _sampling_params(body, max_tokens, engine.engine.generation_defaults)
    if any(token_id >= engine.engine.vocab_size for token_id in params.logit_bias):
        state.metrics.reject("invalid")
        raise ApiError(
            400,
            f"'logit_bias' token ids must be below the vocabulary size {engine.engine.vocab_size}",
            param="logit_bias",
            code="invalid_value",
        )
    try:
        grammar = await check_requested_grammar(engine.engine.grammars, body, tool_grammar)
    except GrammarError as error:
        state.metrics.reject("invalid")
        raise ApiError(400, str(error), param=error.param, code="invalid_value") from error
    if grammar is not None:
        params = params.model_copy(update={"grammar": grammar})
    if body.n > engine.num_slots:
        state.metrics.reject("invalid")
        raise ApiError(
            400,
            f"'n' ({body.n}) exceeds this engine's {engine.num_slots} slots: each choice takes one",
            param="n",
            code="invalid_value",
        )
    try:
        choices = Choices.add(engine, fmt.request_id, prompt, params, body.n)
    except InvalidRequestError as error:
        state.metrics.reject("invalid")
        raise ApiError(400, error.message, param=error.param, code="invalid_value") from error
    except QueueFullError as error:
        state.metrics.reject("queue_full")
        raise ApiError(
            429,
            f"the engine's waiting queue is full ({state.settings.max_waiting}); retry later",
            type_="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},  # the error middleware adds the slot headers
        ) from error
    except EngineNotRunningError as error:
        raise ApiError(
            503, "the engine is not running", type_="service_unavailable_error", code="draining"
        ) from error
    state.begin(fmt.request_id)
    try:
        if body.stream:
            return await _stream_sse(request, state, engine, choices, fmt, body.include_usage)
        return await _collect(state, engine, choices, fmt, params.logprobs is not None)
    finally:
        for request_id in choices.unfinished_ids:
            engine.abort(request_id)  # client gone (or an error): free the slot now
            state.metrics.observe_finished("abort", None)
        state.end(fmt.request_id)
        record_request_phases(request, fmt.request_id, engine, choices.final_outputs)


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


async def _collect(
    state: ServerState,
    engine: AsyncEngine,
    choices: Choices,
    fmt: OutputFormat,
    wants_logprobs: bool,
) -> web.Response:
    n = len(choices.streams)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprobs] | None] = [[] if wants_logprobs else None for _ in range(n)]
    finals: list[RequestOutput | None] = [None] * n
    async for index, output in choices.outputs():
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
        done[0].num_prompt_tokens,  # the prompt is counted once, as OpenAI does
        sum(final.num_generated_tokens for final in done),
    )
    return web.json_response(text=body, headers=slot_headers(engine.stats()))


async def _stream_sse(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    choices: Choices,
    fmt: OutputFormat,
    include_usage: bool,
) -> web.StreamResponse:
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
        num_prompt_tokens = num_generated_tokens = 0
        async for index, output in choices.outputs():
            if not output.finished:
                if output.text or output.logprobs:
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
            num_prompt_tokens = output.num_prompt_tokens
            num_generated_tokens += output.num_generated_tokens
        if include_usage:
            await response.write(fmt.usage_chunk(num_prompt_tokens, num_generated_tokens))
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


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = loaded_engine(state)
    card = ModelCard(
        id=engine.model_name, created=state.started_at, max_model_len=engine.max_model_len
    )
    return web.json_response(text=ModelList(data=[card]).model_dump_json())
