"""Per-request sampling parameters, validated at the boundary so bad values never reach the loop."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Temperatures below this are greedy (vLLM's threshold): the distribution is a point mass to
# within float precision, and dividing logits by e.g. 1e-40 would overflow.
GREEDY_TEMPERATURE_EPSILON = 1e-5

# Bounds on what a request may ask the step loop to check at every token (docs/engine.md). The
# stop-string matcher costs O(number x longest) characters per token, and stop token ids are
# looked up per token too: without bounds one request's body could slow every neighbour.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's limits: chat top_logprobs 0-20 (completions logprobs 0-5), logit_bias -100..100.
MAX_LOGPROBS = 20
# vLLM's ``cache_salt`` (and the gateway's tenant before it, ``x-slotserve-cache-salt``): bounded,
# it is compared on every prefix-cache match.
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0

# Each sampling bound once: SamplingParams, the OpenAI request bodies and the model's generation
# defaults all use these, so what one accepts the others accept.
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=1)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]
MinTokens = Annotated[int, Field(ge=0)]


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """Raise ValueError unless ``min_tokens`` fits in ``max_tokens``."""
    if min_tokens > max_tokens:
        raise ValueError(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})")


class SamplingParams(BaseModel):
    """How one request is decoded; temperature 0 (below ``GREEDY_TEMPERATURE_EPSILON``) means
    greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: MaxTokens = Field(default=16, description="New tokens to generate at most.")
    temperature: Temperature = Field(default=1.0, description="0 = greedy.")
    top_p: TopP = Field(default=1.0, description="Nucleus sampling mass.")
    top_k: TopK | None = Field(default=None, description="Sample among the k most likely tokens.")
    seed: int | None = Field(
        default=None, description="Per-request seed for reproducible sampling."
    )
    stop: list[str] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS, description="Stop strings."
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="Extra stop token ids."
    )
    ignore_eos: bool = Field(
        default=False, description="Keep generating past the end-of-sequence token."
    )
    min_p: MinP = Field(default=0.0, description="Drop tokens below min_p x top prob.")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return the token's logprob and this many top.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_LOGPROBS,
        description=(
            "Return each prompt token's logprob (the first: none) and this many top, from the "
            "prefill's logits; the prompt is then computed whole (no prefix-cache reuse)."
        ),
    )
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = Field(default=1.0, description="HF/vLLM; 1 = off.")
    cache_salt: str | None = Field(
        default=None,
        max_length=2 * MAX_CACHE_SALT_CHARS + 1,  # the gateway's salt, a separator, the client's
        description="Prefix-cache reuse only among requests with the same salt (vLLM).",
    )
    # Gateway-only (``x-slotserve-preempt``, never a body field): the tenant whose running
    # sequence this request may preempt when every slot runs (``core/tenant_preempt.py``).
    preempt_tenant: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Tenant preemption: take a slot from this tenant when all slots run.",
    )
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_ENTRIES)
    min_tokens: MinTokens = Field(
        default=0, description="No EOS or stop token before this many tokens."
    )
    grammar: str | None = Field(
        default=None, description="An llguidance grammar the output must match (structured output)."
    )

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not text for text in stop):
            raise ValueError("stop strings must not be empty")
        if any(len(text) > MAX_STOP_STRING_CHARS for text in stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, ids: list[int]) -> list[int]:
        if any(token_id < 0 for token_id in ids):
            raise ValueError("stop_token_ids must not be negative")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, bias: dict[int, float]) -> dict[int, float]:
        if any(token_id < 0 for token_id in bias):
            raise ValueError("logit_bias token ids must not be negative")
        if any(not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS for value in bias.values()):
            raise ValueError(
                f"logit_bias values must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}"
            )
        return bias

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> SamplingParams:
        check_min_tokens(self.min_tokens, self.max_tokens)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPSILON

    @property
    def has_penalties(self) -> bool:
        """Whether sampling must know which tokens the sequence has seen (costs a count row)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
