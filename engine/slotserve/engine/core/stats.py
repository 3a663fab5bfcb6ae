"""What the engine reports: per-request outputs and metrics, and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.contracts.pool_spec import BatchingPolicy
from slotserve.engine.core.logprobs import PromptTokenLogprobs, TokenLogprobs
from slotserve.engine.core.model.calibration import CalibrationRecord
from slotserve.engine.core.sequence import FinishReason, Sequence, SequenceError


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one finished request, in seconds."""

    queue_time: float  # arrival -> first scheduled
    time_to_first_token: float  # arrival -> first token
    e2e_latency: float  # arrival -> finished
    inter_token_latencies: list[float] = field(default_factory=list)
    # On the engine's clock: with the latencies above it places the request's phases in time
    # (the trace's queued/prefill/decode spans, slotserve/engine/http/tracing.py).
    arrival_time: float = 0.0

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestMetrics:
        arrival = seq.arrival_time
        finish = seq.finish_time if seq.finish_time is not None else arrival
        scheduled = seq.first_scheduled_time if seq.first_scheduled_time is not None else finish
        first_token = seq.first_token_time if seq.first_token_time is not None else finish
        return cls(
            queue_time=scheduled - arrival,
            time_to_first_token=first_token - arrival,
            e2e_latency=finish - arrival,
            inter_token_latencies=list(seq.inter_token_latencies),
            arrival_time=arrival,
        )


@dataclass
class RequestOutput:
    """One delta of a request's output; the last one has ``finished`` and ``metrics`` set."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_generated_tokens: int
    metrics: RequestMetrics | None = None
    # Prompt tokens its slot row held when it was first admitted (its usage's cached_tokens).
    num_cached_tokens: int = 0
    error: SequenceError | None = None  # with finish_reason "error": why, for the client
    logprobs: list[TokenLogprobs] | None = None  # one per token of ``text``, when asked for
    # With ``prompt_logprobs``, on the request's first token's output: one entry per prompt
    # token (the first None) and each prompt token's text.
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    prompt_tokens: list[str] | None = None


@dataclass(frozen=True)
class EngineStats:
    """A cheap snapshot of the engine's state and counters since start."""

    policy: BatchingPolicy
    num_running: int
    num_waiting: int
    num_slots_total: int
    num_slots_free: int
    kv_cache_usage: float
    kv_cache_tokens_total: int
    slot_utilisation: float
    num_steps: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Sequences ended with "error", by reason; steps whose runner raised (each ends all work).
    sequence_failures: dict[str, int] = field(default_factory=dict)
    num_step_failures: int = 0
    # vLLM's prefix-cache counters, in tokens: prompt tokens looked up at admission, and those
    # found in a slot row (not recomputed).
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # What was calibrated at load (measured, or read from the calibration cache), and its cost.
    calibrations: tuple[CalibrationRecord, ...] = ()
    # What the KV cache stores keys and values in (kv_cache_dtype, as chosen at load).
    kv_cache_dtype: str = ""
    # The per-step token budget in force (max_batched_tokens, or the device's default).
    max_batched_tokens: int = 0
    # Per slot row, the request whose tokens it holds for reuse (prefix caching; None: none).
    row_request_ids: tuple[str | None, ...] = ()
    # Per slot row, when it was last used if it is free and holds a prefix (None: not).
    row_idle_since: tuple[float | None, ...] = ()
    # KV rows: the slots, and the spare rows of prefix_cache_rows beyond them (0: not reported).
    num_kv_rows: int = 0
    # Tenant preemptions (a gateway preemptor took a running sequence's slot) and the computed
    # tokens their victims lost (recomputed when they resume, less what the prefix cache keeps).
    num_tenant_preemptions: int = 0
    tenant_recomputed_tokens_total: int = 0


@dataclass(frozen=True)
class StepRecord:
    """Which slot served which request in one step (for occupancy plots)."""

    step: int
    time: float
    slots: dict[int, str]


@dataclass
class FinishedRequest:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics | None
    num_preemptions: int = 0
