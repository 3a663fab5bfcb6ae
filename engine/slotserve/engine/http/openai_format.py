"""Engine outputs -> OpenAI response bodies and server-sent events, for completions and chat."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from pydantic import BaseModel

from slotserve.engine.core.logprobs import (
    CompletionLogprobs,
    TokenLogprobs,
    chat_logprobs,
    completion_logprobs,
)
from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.http.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    Usage,
)

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ChoiceOutput:
    """One whole choice of a response (``n`` of them with ``n > 1``)."""

    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None = None


def sse_event(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class OutputFormat:
    """How one request's outputs are written; a subclass per endpoint."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        # Completions' logprobs, per choice: characters of the tokens already sent.
        self.text_offset: defaultdict[int, int] = defaultdict(int)

    def first_chunk(self, index: int = 0) -> bytes:
        """Bytes sent as soon as the stream opens (chat announces the assistant role)."""
        return b""

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        raise NotImplementedError

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        raise NotImplementedError

    def response(
        self, choices: list[ChoiceOutput], num_prompt_tokens: int, num_generated_tokens: int
    ) -> str:
        raise NotImplementedError


class CompletionFormat(OutputFormat):
    def _body(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _logprobs(
        self, logprobs: list[TokenLogprobs] | None, index: int
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = completion_logprobs(logprobs, self.text_offset[index])
        self.text_offset[index] += sum(len(entry.token) for entry in logprobs)
        return out

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        choice = CompletionChoice(
            index=index,
            text=text,
            finish_reason=finish_reason,
            logprobs=self._logprobs(logprobs, index),
        )
        return sse_event(self._body([choice], None))

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return sse_event(self._body([], Usage.of(num_prompt_tokens, num_generated_tokens)))

    def response(
        self, choices: list[ChoiceOutput], num_prompt_tokens: int, num_generated_tokens: int
    ) -> str:
        out = [
            CompletionChoice(
                index=index,
                text=choice.text,
                finish_reason=choice.finish_reason,
                logprobs=self._logprobs(choice.logprobs, index),
            )
            for index, choice in enumerate(choices)
        ]
        usage = Usage.of(num_prompt_tokens, num_generated_tokens)
        return self._body(out, usage).model_dump_json()


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

    def first_chunk(self, index: int = 0) -> bytes:
        delta = ChatDelta(role="assistant", content="")
        return self._chunk([ChatChunkChoice(index=index, delta=delta)], None)

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            finish_reason=finish_reason,
            logprobs=chat_logprobs(logprobs) if logprobs is not None else None,
        )
        return self._chunk([choice], None)

    def usage_chunk(self, num_prompt_tokens: int, num_generated_tokens: int) -> bytes:
        return self._chunk([], Usage.of(num_prompt_tokens, num_generated_tokens))

    def response(
        self, choices: list[ChoiceOutput], num_prompt_tokens: int, num_generated_tokens: int
    ) -> str:
        out = [
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=choice.text),
                finish_reason=choice.finish_reason,
                logprobs=chat_logprobs(choice.logprobs) if choice.logprobs is not None else None,
            )
            for index, choice in enumerate(choices)
        ]
        return self._response_json(out, num_prompt_tokens, num_generated_tokens)

    def _response_json(
        self, choices: list[ChatChoice], num_prompt_tokens: int, num_generated_tokens: int
    ) -> str:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=Usage.of(num_prompt_tokens, num_generated_tokens),
        ).model_dump_json()
