"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients count tokens against the served tokenizer with them (lm-evaluation-harness picks its
"remote" tokenizer when ``/tokenizer_info`` and ``/tokenize`` answer). The shapes are vLLM's:

- ``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "tools": [...]}`` (the chat template applied, as a chat
  completion would), optionally ``model`` and ``return_token_strs`` ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``/detokenize``: ``{"tokens": [int]}`` -> ``{"prompt": str}``.
- ``/tokenizer_info``: the tokenizer's class, special tokens, chat template and length.

They take no slot and never reach the step loop: encoding runs in the tokenizer's worker process
(bounded like a prompt: a text that cannot fit in the context is refused, 400), decoding on a
thread under the engine's tokenizer lock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import Field, field_validator, model_validator

from slotserve.engine.core.errors import InvalidRequestError
from slotserve.engine.core.tokenize import TokenizerUnavailableError
from slotserve.engine.http.http_state import STATE, ApiError, loaded_engine
from slotserve.engine.http.openai_api import ChatMessage, RequestModel
from slotserve.engine.http.openai_routes import (
    _check_model,
    _invalid,
    _parse_body,
    _tokenizer_unavailable,
)
from slotserve.engine.http.tool_calls import Tool


class TokenizeRequest(RequestModel):
    """Either ``prompt`` (a completion's text) or ``messages`` (a chat, templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("'prompt' or 'messages' is required (one of them)")
        if self.messages is None and self.tools is not None:
            raise ValueError("'tools' is only allowed with 'messages'")
        if self.messages is not None and self.add_special_tokens:
            # The template writes the special tokens itself (vLLM's default is false here too).
            raise ValueError("'add_special_tokens' must be false with 'messages'")
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)

    @field_validator("tokens")
    @classmethod
    def _not_negative(cls, value: list[int]) -> list[int]:
        if any(token_id < 0 for token_id in value):
            raise ValueError("'tokens' must not hold negative ids")
        return value


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = loaded_engine(state)
    body = await _parse_body(request, TokenizeRequest, state)
    if body.model is not None:
        _check_model(engine, body.model, state)
    try:
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            # Not on their way to the engine: an idle engine does not wait for them.
            tokens = await engine.prompts.encode(
                body.prompt, add_special_tokens=add_special, for_engine=False
            )
        else:
            assert body.messages is not None
            messages = [message.template_message() for message in body.messages]
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
            tokens = await engine.prompts.encode_chat(
                messages,
                tools,
                add_generation_prompt=body.add_generation_prompt,
                for_engine=False,
            )
    except InvalidRequestError as error:
        raise _invalid(error, state) from error
    except TokenizerUnavailableError as error:
        raise _tokenizer_unavailable(error) from error
    token_strs = await _token_strings(request, tokens) if body.return_token_strs else None
    return web.json_response(
        {
            "count": len(tokens),
            "max_model_len": engine.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = loaded_engine(state)
    body = await _parse_body(request, DetokenizeRequest, state)
    if body.model is not None:
        _check_model(engine, body.model, state)
    vocab_size = engine.engine.vocab_size
    if any(token_id >= vocab_size for token_id in body.tokens):
        raise ApiError(
            400,
            f"'tokens' holds an id outside the vocabulary (0 to {vocab_size - 1})",
            param="tokens",
            code="invalid_value",
        )
    core = engine.engine

    def work() -> str:
        with core.tokenizer_lock:
            return core.tokenizer.decode(body.tokens)

    return web.json_response({"prompt": await asyncio.to_thread(work)})


async def tokenizer_info(request: web.Request) -> web.Response:
    engine = loaded_engine(request.app[STATE])
    tokenizer: Any = engine.engine.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = None if value is None else str(value)
    template = tokenizer.chat_template
    info["chat_template"] = template if isinstance(template, str) else None
    info["model_max_length"] = engine.max_model_len
    info["add_bos_token"] = bool(getattr(tokenizer, "add_bos_token", False))
    return web.json_response(info)


async def _token_strings(request: web.Request, tokens: list[int]) -> list[str]:
    core = loaded_engine(request.app[STATE]).engine
    tokenizer: Any = core.tokenizer
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)

    def work() -> list[str]:
        with core.tokenizer_lock:
            if convert is not None:
                return [str(token) for token in convert(tokens)]
            return [tokenizer.decode([token_id]) for token_id in tokens]

    return await asyncio.to_thread(work)
