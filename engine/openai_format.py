"""Engine outputs -> OpenAI response bodies and server-sent events, for completions and chat."""

from __future__ import annotations

import time

from pydantic import BaseModel

from slotserve.engine.logprobs import TokenLogprobs, chat_logprobs, completion_logprobs
from slotserve.engine.openai_api import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
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
        self.text_offset = 0  # completions' logprobs: characters of tokens already sent

    def first_chunk(self) -> bytes:
        """Bytes sent as soon as the stream opens (chat announces the assistant role)."""
        return b""

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        raise NotImplementedError

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        raise NotImplementedError

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> str:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(self, logprobs: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = completion_logprobs(logprobs, self.text_offset)
        self.text_offset += sum(len(entry.token) for entry in logprobs)
        return out

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        choice = CompletionChoice(
            text=text, finish_reason=finish_reason, logprobs=self._logprobs(logprobs)
        )
        return sse_event(self._body([choice], None))

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return sse_event(self._body([], Usage.of(num_prompt_tokens, num_generated_tokens)))

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> str:
        choice = CompletionChoice(
            text=text, finish_reason=finish_reason, logprobs=self._logprobs(logprobs)
        )
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

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> bytes:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        choice = ChatChunkChoice(
            delta=delta,
            finish_reason=finish_reason,
            logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
        )
        return self._chunk([choice], None)

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return self._chunk([], Usage.of(num_prompt_tokens, num_generated_tokens))

    def response(
        self,
        text: str,
        finish_reason: FinishReason | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> str:
        choice = ChatChoice(
            message=ChatMessageOut(content=text),
            finish_reason=finish_reason,
            logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
        )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=Usage.of(num_prompt_tokens, num_generated_tokens),
        ).model_dump_json()
