"""Engine outputs -> OpenAI response bodies and server-sent events, for completions and chat."""

from __future__ import annotations

import time

from pydantic import BaseModel

from slotserve.engine.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    FinishReason,
    Usage,
)

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class OutputFormat:
    """How one request's outputs are written; a subclass per endpoint."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def first_chunk(self) -> bytes:
        """Bytes sent as soon as the stream opens (chat announces the assistant role)."""
        return b""

    def chunk(self, text: str, finish_reason: FinishReason | None) -> bytes:
        raise NotImplementedError

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        raise NotImplementedError

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
    ) -> str:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def chunk(self, text: str, finish_reason: FinishReason | None) -> bytes:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return sse_event(self._body([choice], None))

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return sse_event(self._body([], Usage.of(num_prompt_tokens, num_generated_tokens)))

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
    ) -> str:
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        usage = Usage.of(num_prompt_tokens, num_generated_tokens)
        return self._body([choice], usage).model_dump_json()


class ChatFormat(OutputFormat):
    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage,
            )
        )

    def first_chunk(self) -> bytes:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))], None)

    def chunk(self, text: str, finish_reason: FinishReason | None) -> bytes:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason)], None)

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return self._chunk([], Usage.of(num_prompt_tokens, num_generated_tokens))

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
    ) -> str:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=finish_reason)],
            usage=Usage.of(num_prompt_tokens, num_generated_tokens),
        ).model_dump_json()
