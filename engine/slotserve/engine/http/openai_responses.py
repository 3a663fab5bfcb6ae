"""OpenAI-compatible response bodies of the engine's HTTP API: whole answers, stream chunks,
the model list and the error body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.http.openai_logprobs import ChatLogprobs, CompletionLogprobs
from slotserve.engine.http.tool_calls import ToolCall, ToolCallDelta


def _is_none(value: object) -> bool:
    return value is None


@dataclass(frozen=True)
class TokenCounts:
    """A request's tokens as its usage reports them: prompt tokens (each prompt counted once),
    generated tokens, and the prompt tokens its slot rows already held (not prefilled)."""

    prompt: int
    generated: int
    cached: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's field: the prompt tokens served from the prefix cache (the engine's rows).
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, counts: TokenCounts) -> Usage:
        return cls(
            prompt_tokens=counts.prompt,
            completion_tokens=counts.generated,
            total_tokens=counts.prompt + counts.generated,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached),
        )


class PromptLogprobEntry(BaseModel):
    """One token of vLLM's ``prompt_logprobs``: its logprob, rank and text."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's: per prompt token (the first null), token id -> entry; only when asked for.
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = Field(
        default=None, exclude_if=_is_none
    )


class CompletionResponse(BaseModel):
    """A whole completion, and (with ``finish_reason`` None until the end) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | Literal["tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | Literal["tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "slotserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
