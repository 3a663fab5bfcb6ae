"""Log probabilities of sampled and prompt tokens, as the sampler returns them and the engine
hands them on (OpenAI's response shapes are built in ``http/openai_logprobs.py``).

Convention (vLLM's ``--logprobs-mode processed_logprobs``): a logprob is taken from the
distribution the token was actually drawn from, after ``logit_bias``, ``min_tokens``, the
penalties, the temperature (greedy rows: none) and the ``top_k`` / ``top_p`` / ``min_p`` masks.
A token those masks removed has probability 0; its ``-inf`` is written as ``-9999.0``, as vLLM
does, because JSON has no infinity. Pure Python: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
