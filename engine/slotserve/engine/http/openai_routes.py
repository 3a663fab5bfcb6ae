"""The OpenAI endpoints: completions and chat completions (plain and SSE) and the model list.

A request is parsed strictly, checked against the served model, turned into token ids (chat
through the tokenizer's template) and handed to the engine; its outputs are written as one JSON
body or as server-sent events (:mod:`slotserve.engine.http.openai_replies`). Whatever ends the
handler early (client gone, error) aborts the sequence, so its slot is free at the next engine
step.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from slotserve.contracts.headers import CACHE_SALT_HEADER, PREEMPT_HEADER
from slotserve.contracts.prefix_keys import NO_CHAIN, PrefixChain, request_chain
from slotserve.engine.core.errors import EngineNotRunningError, InvalidRequestError, QueueFullError
from slotserve.engine.core.generation_defaults import GenerationDefaults
from slotserve.engine.core.params import MAX_CACHE_SALT_CHARS, SamplingParams, check_min_tokens
from slotserve.engine.core.structured import GrammarError
from slotserve.engine.core.tokenize import PromptTooLongError, TokenizerUnavailableError
from slotserve.engine.http.choices import Choices
from slotserve.engine.http.echo import echoed_prompts
from slotserve.engine.http.http_state import (
    STATE,
    ApiError,
    ServerState,
    accepting_engine,
    broken_engine_error,
    loaded_engine,
)
from slotserve.engine.http.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    cache_salt_of,
    describe_validation_error,
)
from slotserve.engine.http.openai_format import (
    ChatFormat,
    CompletionFormat,
    CompletionOptions,
    OutputFormat,
)
from slotserve.engine.http.openai_replies import collect, stream_sse
from slotserve.engine.http.openai_responses import ModelCard, ModelList
from slotserve.engine.http.structured_request import check_requested_grammar
from slotserve.engine.http.tool_calls import ToolPlan, check_tool_schemas, plan_tools
from slotserve.engine.http.tool_format import ToolChatFormat
from slotserve.engine.http.tracing import record_request_phases

if TYPE_CHECKING:
    from slotserve.engine.core.async_engine import AsyncEngine

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=BaseModel)


# ---------------------------------------------------------------------------------------------
# Completions


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _admit(state)
    body = await _parse_body(request, CompletionRequest, state)
    _check_model(engine, body.model, state)
    prompts = [await _encode(engine, state, prompt) for prompt in body.prompts]
    max_tokens = body.requested_max_tokens()
    if "max_tokens" not in body.model_fields_set:
        max_tokens = engine.engine.generation_defaults.max_tokens or max_tokens
    # max_tokens 0 (with echo: lm-eval's scoring request) generates nothing; the engine still
    # samples one token to end the prefill, and that token is dropped from the answer.
    score_only = max_tokens == 0
    if score_only:
        _check_scorable(engine, state, prompts)
    if max_tokens is None:  # explicit null: as many tokens as fit, per prompt
        lengths = [engine.limits.room_after(len(prompt)) for prompt in prompts]
    else:
        lengths = [max(max_tokens, 1)] * len(prompts)
    options = CompletionOptions(
        echo=(await echoed_prompts(engine, body, prompts)) if body.echo else None,
        per_prompt=body.n,
        score_only=score_only,
        num_logprobs=body.logprobs,
        num_prompt_logprobs=body.prompt_logprobs,
    )
    fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", engine.model_name, options)
    batch = list(zip(prompts, lengths, strict=True))
    return await _generate(request, state, engine, body, batch, fmt)


def _check_scorable(engine: AsyncEngine, state: ServerState, prompts: list[list[int]]) -> None:
    """A prompt scored with max_tokens 0 still ends its prefill with one sampled token."""
    for prompt in prompts:
        if len(prompt) >= engine.max_model_len:
            state.metrics.reject("invalid")
            raise ApiError(
                400,
                f"this model's maximum context length is {engine.max_model_len} tokens; the "
                f"prompt has {len(prompt)} tokens, and scoring it (max_tokens 0) needs one "
                "position more",
                param="prompt",
                code="context_length_exceeded",
            )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = _admit(state)
    body = await _parse_body(request, ChatCompletionRequest, state)
    return await run_chat(request, state, engine, body)


FormatFactory = Callable[[str, ToolPlan], OutputFormat]


def chat_format(engine: AsyncEngine) -> FormatFactory:
    def make(request_id: str, tools: ToolPlan) -> OutputFormat:
        if tools.parses:
            return ToolChatFormat(request_id, engine.model_name, tools)
        return ChatFormat(request_id, engine.model_name)

    return make


async def run_chat(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    body: ChatCompletionRequest,
    make_format: FormatFactory | None = None,
    id_prefix: str = "chatcmpl-",
) -> web.StreamResponse:
    """A chat request through the template, the tools and the engine; the answer is written by
    ``make_format`` (chat completions by default; the Responses API writes its own)."""
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
    room = engine.limits.room_after(len(prompt))
    default_max_tokens = engine.engine.generation_defaults.max_tokens
    max_tokens = body.requested_max_tokens() or min(default_max_tokens or room, room)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    fmt = (make_format or chat_format(engine))(request_id, tools)
    batch = [(prompt, max_tokens)]
    return await _generate(request, state, engine, body, batch, fmt, tools.grammar())


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
        engine.limits.check_not_empty(prompt)
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
    chosen: dict[str, float | int | None] = {
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
    try:
        check_min_tokens(body.min_tokens, max_tokens)
    except ValueError as error:
        raise ApiError(400, str(error), param="min_tokens", code="invalid_value") from error
    prompt_logprobs = body.num_prompt_logprobs if isinstance(body, CompletionRequest) else None
    try:
        return SamplingParams.model_validate(
            {
                **chosen,
                "max_tokens": max_tokens,
                "seed": body.seed,
                "stop": body.stop_list,
                "stop_token_ids": body.stop_token_ids or [],
                "ignore_eos": body.ignore_eos,
                "logprobs": body.num_logprobs,
                "prompt_logprobs": prompt_logprobs,
                "presence_penalty": body.presence_penalty,
                "frequency_penalty": body.frequency_penalty,
                "logit_bias": body.logit_bias_ids,
                "min_tokens": body.min_tokens,
            }
        )
    except ValidationError as error:
        message, param, code = describe_validation_error(error)
        raise ApiError(400, message, param=param, code=code) from error


async def _generate(
    request: web.Request,
    state: ServerState,
    engine: AsyncEngine,
    body: SamplingRequest,
    batch: list[tuple[list[int], int]],
    fmt: OutputFormat,
    tool_grammar: tuple[str, str] | None = None,
) -> web.StreamResponse:
    """Run ``body.n`` choices of each (prompt, max_tokens) of ``batch`` and write the answer."""
    defaults = engine.engine.generation_defaults
    params_of: dict[int, SamplingParams] = {}
    for _prompt, max_tokens in batch:
        if max_tokens not in params_of:
            params_of[max_tokens] = _sampling_params(body, max_tokens, defaults)
    try:  # the tenant's salt (from the gateway) and the client's own (issue 26)
        salt = cache_salt_of(request.headers.get(CACHE_SALT_HEADER), body.cache_salt)
    except ValueError as error:
        raise ApiError(400, str(error), param="cache_salt", code="invalid_value") from error
    params_of = {k: v.model_copy(update={"cache_salt": salt}) for k, v in params_of.items()}
    victim = request.headers.get(PREEMPT_HEADER)  # a preempting grant (core/tenant_preempt.py)
    if victim:
        if len(victim) > MAX_CACHE_SALT_CHARS:
            raise ApiError(400, "the preempt header is too long", code="invalid_value")
        params_of = {
            k: v.model_copy(update={"preempt_tenant": victim}) for k, v in params_of.items()
        }
    params = next(iter(params_of.values()))
    chain = await _prefix_chain(request, body, salt, len(batch))
    try:
        engine.limits.check_logit_bias(params.logit_bias)
    except InvalidRequestError as error:
        raise _invalid(error, state) from error
    try:
        grammar = await check_requested_grammar(engine.engine.grammars, body, tool_grammar)
    except GrammarError as error:
        state.metrics.reject("invalid")
        raise ApiError(400, str(error), param=error.param, code="invalid_value") from error
    if grammar is not None:
        params_of = {
            key: value.model_copy(update={"grammar": grammar}) for key, value in params_of.items()
        }
    try:
        engine.limits.check_num_choices(body.n)
        choices = Choices.add_batch(
            engine,
            fmt.request_id,
            [(prompt, params_of[max_tokens]) for prompt, max_tokens in batch],
            body.n,
        )
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
        # The loop stopped between accepting_engine() and here: say why, so the gateway
        # retries elsewhere at once (a step failure) or after a beat (a drain).
        if engine.failure is not None:
            raise broken_engine_error(engine.failure) from error
        raise ApiError(
            503,
            "the engine is not running; send the request to another replica",
            type_="service_unavailable_error",
            code="draining",
            headers={"Retry-After": "1"},
        ) from error
    state.prefix_rows.started([stream.request_id for stream in choices.streams], chain)
    state.begin(fmt.request_id)
    try:
        if body.stream:
            return await stream_sse(request, state, engine, choices, fmt, body.include_usage)
        return await collect(state, engine, choices, fmt, params.logprobs is not None)
    finally:
        for request_id in choices.unfinished_ids:
            engine.abort(request_id)  # client gone (or an error): free the slot now
            state.metrics.observe_finished("abort", None)
        state.end(fmt.request_id)
        _note_answers(state, choices, chain)
        record_request_phases(request, fmt.request_id, engine, choices.final_outputs)


async def _prefix_chain(
    request: web.Request, body: SamplingRequest, salt: str | None, num_prompts: int
) -> PrefixChain:
    """The request's prefix keys, as the gateway computes them from the same body
    (``contracts.prefix_keys``): one prompt only, under the salt its rows are matched with."""
    if num_prompts != 1:
        return NO_CHAIN
    try:
        payload = json.loads(await request.read())
    except ValueError:
        return NO_CHAIN
    if not isinstance(payload, dict):
        return NO_CHAIN
    return request_chain(isinstance(body, ChatCompletionRequest), payload, salt or "")


def _note_answers(state: ServerState, choices: Choices, chain: PrefixChain) -> None:
    """Rows of choices that ended well hold their answers too; the others' keys stay as noted
    (a failed row is forgotten by the prefix cache itself)."""
    for index, output in enumerate(choices.final_outputs):
        if output is not None and output.finish_reason in ("stop", "length"):
            answer = "".join(choices.texts[index])
            state.prefix_rows.finished(output.request_id, chain, answer)
    state.prefix_rows.ended([stream.request_id for stream in choices.streams])


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = loaded_engine(state)
    card = ModelCard(
        id=engine.model_name, created=state.started_at, max_model_len=engine.max_model_len
    )
    return web.json_response(text=ModelList(data=[card]).model_dump_json())
