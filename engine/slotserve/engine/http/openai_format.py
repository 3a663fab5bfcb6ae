"""Engine outputs -> OpenAI response bodies and server-sent events, for completions and chat."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, replace

from pydantic import BaseModel

from slotserve.engine.core.logprobs import PromptTokenLogprobs, TokenLogprobs
from slotserve.engine.core.sequence import FinishReason
from slotserve.engine.core.stats import RequestOutput
from slotserve.engine.http.openai_logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
)
from slotserve.engine.http.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptLogprobEntry,
    TokenCounts,
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

    def observe(self, index: int, output: RequestOutput) -> None:
        """Sees every output of choice ``index`` before it is written (echo keeps the prompt's
        logprobs from the first one)."""

    def has_pending(self, index: int) -> bool:
        """Whether choice ``index`` has something to send even with no new text (the echo)."""
        return False

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        raise NotImplementedError

    def usage_chunk(self, counts: TokenCounts) -> bytes:
        raise NotImplementedError

    def response(self, choices: list[ChoiceOutput], counts: TokenCounts) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt as ``echo`` writes it before each of its choices: its text, and where each of
    its tokens starts in that text (for ``text_offset``; None when no logprobs are asked)."""

    text: str
    offsets: list[int] | None = None


@dataclass(frozen=True)
class CompletionOptions:
    """What a completion request asks beyond plain text: see ``CompletionRequest``."""

    echo: list[EchoedPrompt] | None = None  # one per prompt
    per_prompt: int = 1  # choices per prompt (n)
    score_only: bool = False  # max_tokens 0: the prompt alone, its generated token dropped
    num_logprobs: int | None = None  # ``logprobs``
    num_prompt_logprobs: int | None = None  # vLLM's ``prompt_logprobs``


class CompletionFormat(OutputFormat):
    def __init__(
        self, request_id: str, model: str, options: CompletionOptions | None = None
    ) -> None:
        super().__init__(request_id, model)
        self.options = options or CompletionOptions()
        # Per choice: the prompt's tokens and logprobs (from its first output), and whether the
        # prompt part (echo, vLLM's prompt_logprobs) has been written.
        self._prompt: dict[int, tuple[list[str], list[PromptTokenLogprobs | None]]] = {}
        self._prompt_sent: set[int] = set()

    def observe(self, index: int, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None and output.prompt_tokens is not None:
            self._prompt[index] = (output.prompt_tokens, output.prompt_logprobs)

    def has_pending(self, index: int) -> bool:
        wants_prompt = self.options.echo is not None or self.options.num_prompt_logprobs is not None
        return wants_prompt and index not in self._prompt_sent

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

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None,
    ) -> CompletionChoice:
        options = self.options
        if options.score_only:  # the one token sampled to end the prefill is not the answer
            text, logprobs = "", ([] if logprobs is not None else None)
            finish_reason = "length" if finish_reason is not None else None
        choice_logprobs = None
        prompt_logprobs = None
        if index not in self._prompt_sent:
            self._prompt_sent.add(index)
            echo = options.echo[index // options.per_prompt] if options.echo else None
            if echo is not None:
                self.text_offset[index] = len(echo.text)
                text = echo.text + text
                if options.num_logprobs is not None:
                    choice_logprobs = self._echo_logprobs(index, echo, options.num_logprobs)
            if options.num_prompt_logprobs is not None:
                prompt_logprobs = self._vllm_prompt_logprobs(index, options.num_prompt_logprobs)
        generated = self._logprobs(logprobs, index)
        if choice_logprobs is not None and generated is not None:
            choice_logprobs = CompletionLogprobs(
                tokens=choice_logprobs.tokens + generated.tokens,
                token_logprobs=choice_logprobs.token_logprobs + generated.token_logprobs,
                top_logprobs=choice_logprobs.top_logprobs + generated.top_logprobs,
                text_offset=choice_logprobs.text_offset + generated.text_offset,
            )
        return CompletionChoice(
            index=index,
            text=text,
            finish_reason=finish_reason,
            logprobs=choice_logprobs if choice_logprobs is not None else generated,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_of(self, index: int) -> tuple[list[str], list[PromptTokenLogprobs | None]]:
        try:
            return self._prompt[index]
        except KeyError:
            raise RuntimeError(f"no prompt logprobs for choice {index}") from None

    def _echo_logprobs(self, index: int, echo: EchoedPrompt, k: int) -> CompletionLogprobs:
        """The prompt's part of ``logprobs``: the first token's logprob is null (nothing
        predicts it), as in OpenAI's and vLLM's answers."""
        tokens, entries = self._prompt_of(index)
        offsets = echo.offsets or cumulative_offsets(tokens)
        return CompletionLogprobs(
            tokens=list(tokens),
            token_logprobs=[None if e is None else e.logprob for e in entries],
            top_logprobs=[
                None if e is None else {**dict(e.top[:k]), e.token: e.logprob} for e in entries
            ],
            text_offset=list(offsets),
        )

    def _vllm_prompt_logprobs(
        self, index: int, k: int
    ) -> list[dict[str, PromptLogprobEntry] | None]:
        _tokens, entries = self._prompt_of(index)
        out: list[dict[str, PromptLogprobEntry] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            item = {
                str(entry.token_id): PromptLogprobEntry(
                    logprob=entry.logprob, rank=entry.rank, decoded_token=entry.token
                )
            }
            for rank, (token_id, (token, logprob)) in enumerate(
                zip(entry.top_ids[:k], entry.top[:k], strict=True), start=1
            ):
                item.setdefault(
                    str(token_id),
                    PromptLogprobEntry(logprob=logprob, rank=rank, decoded_token=token),
                )
            out.append(item)
        return out

    def chunk(
        self,
        text: str,
        finish_reason: FinishReason | None,
        logprobs: list[TokenLogprobs] | None = None,
        index: int = 0,
    ) -> bytes:
        return sse_event(self._body([self._choice(index, text, finish_reason, logprobs)], None))

    def _usage(self, counts: TokenCounts) -> Usage:
        return Usage.of(replace(counts, generated=0) if self.options.score_only else counts)

    def usage_chunk(self, counts: TokenCounts) -> bytes:
        return sse_event(self._body([], self._usage(counts)))

    def response(self, choices: list[ChoiceOutput], counts: TokenCounts) -> str:
        out = [
            self._choice(index, choice.text, choice.finish_reason, choice.logprobs)
            for index, choice in enumerate(choices)
        ]
        return self._body(out, self._usage(counts)).model_dump_json()


def cumulative_offsets(tokens: list[str]) -> list[int]:
    """Each token's start when the texts of the tokens before it are laid end to end."""
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


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

    def usage_chunk(self, counts: TokenCounts) -> bytes:
        return self._chunk([], Usage.of(counts))

    def response(self, choices: list[ChoiceOutput], counts: TokenCounts) -> str:
        out = [
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=choice.text),
                finish_reason=choice.finish_reason,
                logprobs=chat_logprobs(choice.logprobs) if choice.logprobs is not None else None,
            )
            for index, choice in enumerate(choices)
        ]
        return self._response_json(out, counts)

    def _response_json(self, choices: list[ChatChoice], counts: TokenCounts) -> str:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=Usage.of(counts),
        ).model_dump_json()
