"""OpenAI's logprobs shapes: ``choices[].logprobs`` of chat completions and of completions,
built from the engine's :class:`~slotserve.engine.core.logprobs.TokenLogprobs`."""

from __future__ import annotations

from pydantic import BaseModel

from slotserve.engine.core.logprobs import TokenLogprobs


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _top(token: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


def chat_logprobs(entries: list[TokenLogprobs]) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion (or of one stream chunk)."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=entry.token,
                logprob=entry.logprob,
                bytes=list(entry.token.encode()),
                top_logprobs=[_top(token, lp) for token, lp in entry.top],
            )
            for entry in entries
        ]
    )


def completion_logprobs(entries: list[TokenLogprobs], text_offset: int) -> CompletionLogprobs:
    """``choices[].logprobs`` of a completion; ``text_offset`` is where the first token's text
    starts in the whole output. As in vLLM, each ``top_logprobs`` entry holds the sampled token
    as well as the ``logprobs`` most likely ones."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return CompletionLogprobs(
        tokens=[entry.token for entry in entries],
        token_logprobs=[entry.logprob for entry in entries],
        top_logprobs=[{**dict(entry.top), entry.token: entry.logprob} for entry in entries],
        text_offset=offsets,
    )
