"""Log probabilities of sampled tokens, from the sampler to OpenAI's response shapes.

Convention (vLLM's ``--logprobs-mode processed_logprobs``): a logprob is taken from the
distribution the token was actually drawn from, after ``logit_bias``, ``min_tokens``, the
penalties, the temperature (greedy rows: none) and the ``top_k`` / ``top_p`` / ``min_p`` masks.
A token those masks removed has probability 0; its ``-inf`` is written as ``-9999.0``, as vLLM
does, because JSON has no infinity. Pure Python: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel

from slotserve.engine.core.protocols import Tokenizer

# JSON has no -inf: a masked token's logprob is written as this (vLLM's value).
MASKED_LOGPROB = -9999.0


@dataclass(frozen=True)
class SampledLogprobs:
    """What the sampler returns for one row that asked for logprobs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the ``logprobs`` most likely (id, logprob), best first


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprob under the model's raw distribution (the prefill's logits at
    the position before it; no sampling settings apply), its rank (1: the most likely) and the
    ``prompt_logprobs`` most likely (id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's logprobs with texts, as the engine hands them to the HTTP layer."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class PromptTokenLogprobs(TokenLogprobs):
    """A prompt token's logprobs with texts, and the ids and rank vLLM's ``prompt_logprobs``
    shape carries."""

    token_id: int = 0
    rank: int = 1
    top_ids: tuple[int, ...] = ()


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


class TokenTexts:
    """Token id -> its text, cached (called under the engine's tokenizer lock)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    def decode(self, sampled: SampledLogprobs) -> TokenLogprobs:
        return TokenLogprobs(
            token=self(sampled.token_id),
            logprob=finite(sampled.logprob),
            top=tuple((self(token_id), finite(lp)) for token_id, lp in sampled.top),
        )

    def decode_prompt(self, entry: PromptLogprob) -> PromptTokenLogprobs:
        return PromptTokenLogprobs(
            token=self(entry.token_id),
            logprob=finite(entry.logprob),
            top=tuple((self(token_id), finite(lp)) for token_id, lp in entry.top),
            token_id=entry.token_id,
            rank=entry.rank,
            top_ids=tuple(token_id for token_id, _ in entry.top),
        )


# ---------------------------------------------------------------------------------------------
# OpenAI shapes


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
