"""One request's state while the engine serves it (a plain dataclass: it lives in the hot loop)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from slotserve.engine.core.logprobs import PromptLogprob
from slotserve.engine.core.params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]

# Why a sequence ended with "error" (the label of slotserve_sequence_failures_total).
FailureReason = Literal[
    "non_finite_logits", "sampling", "detokenizer", "internal", "engine_failure"
]


@dataclass(frozen=True)
class SequenceError:
    """Why one sequence failed. ``engine_failure`` means the runner broke and every sequence
    ended: not this request's fault, so another replica may serve it (503, not 500)."""

    reason: FailureReason
    message: str  # for the client; never holds prompt text (it may reach logs)

    @property
    def is_engine_failure(self) -> bool:
        return self.reason == "engine_failure"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, progress and timestamps of one request.

    ``token_ids`` holds prompt then generated tokens. ``num_computed_tokens`` counts the leading
    tokens whose keys and values are in the KV cache; a step computes the next chunk of the rest
    and, when the chunk reaches the last token, samples one new token. After a preemption the
    count drops to 0 and the whole sequence (prompt and generated so far) is recomputed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: SequenceError | None = None  # set with finish_reason "error"
    num_computed_tokens: int = 0
    # KV bookkeeping (owned by KVCacheManager): the slot row and the token positions reserved.
    slot: int | None = None
    num_kv_tokens: int = 0
    num_preemptions: int = 0
    # Tokens reused from the prefix cache at its first admission (not after a preemption).
    num_cached_tokens: int = 0
    # The request's random generator (a torch.Generator, created by the runner on first use).
    generator: Any = None
    # The structured-output matcher (llguidance), when the request has a grammar.
    matcher: Any = None
    # Timestamps on the engine's clock (seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    # Step number (1-based) at which the sequence was last admitted to a slot; for tests/plots.
    admitted_step: int | None = None
    finished_step: int | None = None
    # With ``params.prompt_logprobs``: one entry per prompt token, filled by the runner from the
    # prefill's logits (entry 0 stays None: nothing predicts the first token).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # The first prompt token whose logprob is still missing (== num_prompt_tokens: all there).
    num_prompt_logprobs_done: int = 1

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens
        else:
            self.num_prompt_logprobs_done = self.num_prompt_tokens

    @property
    def max_reusable_tokens(self) -> int:
        """How many leading tokens may come from the prefix cache instead of being computed.

        At most all but the last (the step computes it to sample from its logits); with prompt
        logprobs still missing, none past the first of them: the logprob of token ``i`` comes
        from the logits at position ``i - 1``, and a cached row holds keys and values, not
        logits. So a request with prompt logprobs computes its prompt whole (its row is then
        cached for the next requests as usual), and once they are all in (after a preemption)
        it reuses like any other.
        """
        if self.num_prompt_logprobs_done >= self.num_prompt_tokens:
            return len(self.token_ids) - 1
        return self.num_prompt_logprobs_done - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
