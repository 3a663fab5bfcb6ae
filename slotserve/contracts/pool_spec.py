"""The batching and admission policy of one pool: shared by the CRD, the gateway and the engine.

Each batching field is declared once here, with its bounds and description, as an ``Annotated``
type: ``BatchingSpec`` (the CRD's ``spec.batching`` and the gateway's pool file) and the engine's
``EngineSettings`` both use these types, so they accept and reject the same values. Field names
are camelCase on the wire (CRD, YAML config) and snake_case in Python.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

BatchingPolicy = Literal["static", "dynamic", "continuous"]
BATCHING_POLICIES: tuple[BatchingPolicy, ...] = get_args(BatchingPolicy)
TimeoutAction = Literal["REJECT", "DELAY"]
MAX_PRIORITY_LEVELS = 9  # x-slotserve-priority is 1 (first) .. 9

# The defaults every part starts from (DESIGN.md's InferencePool sketch).
DEFAULT_POLICY: BatchingPolicy = "continuous"
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS = 100
# The per-step token budget of a pool that leaves it unset, by device. A GPU needs thousands of
# rows a step to keep its products busy (DESIGN.md's 2,048). A CPU's products reach their rate at
# a few hundred rows, and every prompt of a step gets its first token when the whole step ends,
# so half the budget there halves time to first token under a burst at the same throughput
# (docs/engine.md, "Step budget": measured against vLLM's CPU build).
DEFAULT_MAX_BATCHED_TOKENS = 2048
CPU_MAX_BATCHED_TOKENS = 1024

Policy = Annotated[BatchingPolicy, Field(description="static | dynamic | continuous (default).")]
MaxBatchSize = Annotated[
    int, Field(ge=1, le=1024, description="Sequences per engine step: the slots of one replica.")
]
MaxQueueDelayMicroseconds = Annotated[
    int,
    Field(
        ge=0,
        le=60_000_000,
        description=(
            "Longest the engine holds a waiting request back to let a batch fill"
            " (static and dynamic policies)."
        ),
    ),
]
PreferredBatchSizes = Annotated[
    list[int],
    Field(description="Batch sizes the dynamic policy prefers, each at most maxBatchSize."),
]
# At least 16, the bound the CRD has published since v1alpha1: a smaller budget cannot give even
# a small batch one token each per step, so it is a typo, not a tuning. The engine took 1 before
# and now refuses what the CRD refuses (the API does not loosen to match a looser copy).
MaxBatchedTokens = Annotated[
    int,
    Field(
        ge=16,
        le=1_048_576,
        description="Per-step token budget (chunked prefill); unset: 1024 on CPU, 2048 on GPU.",
    ),
]


def default_max_batched_tokens(device_type: str) -> int:
    """The step budget of an engine on ``device_type`` ("cpu", "cuda", "mps") when unset."""
    return CPU_MAX_BATCHED_TOKENS if device_type == "cpu" else DEFAULT_MAX_BATCHED_TOKENS


# Far more than any memory holds at a useful max_model_len; bounds the bookkeeping a typo asks for.
MAX_PREFIX_CACHE_ROWS = 4096
PrefixCacheRows = Annotated[
    int,
    Field(
        ge=0,
        le=MAX_PREFIX_CACHE_ROWS,
        description="KV rows of an engine, each maxModelLen positions: 0 (the default) or at "
        "least maxBatchSize. Rows beyond maxBatchSize keep the most recently finished prefixes "
        "for reuse (a conversation's history, a system prompt), at the memory of a row each; "
        "an engine whose rows do not fit its memory exits 2 at start.",
    ),
]


def prefix_cache_rows_fit(prefix_cache_rows: int, max_batch_size: int) -> bool:
    """Whether ``prefix_cache_rows`` gives every slot a row (0: one row per slot)."""
    return prefix_cache_rows == 0 or prefix_cache_rows >= max_batch_size


def preferred_sizes_fit(preferred_batch_sizes: list[int], max_batch_size: int) -> bool:
    """Whether every preferred batch size is a batch that ``max_batch_size`` slots can run."""
    return all(1 <= size <= max_batch_size for size in preferred_batch_sizes)


class WireModel(BaseModel):
    """Base for boundary models: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class BatchingSpec(WireModel):
    """How an engine groups sequences into steps (Triton's names where they exist)."""

    policy: Policy = DEFAULT_POLICY
    max_batch_size: MaxBatchSize = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_microseconds: MaxQueueDelayMicroseconds = DEFAULT_MAX_QUEUE_DELAY_MICROSECONDS
    preferred_batch_sizes: PreferredBatchSizes = Field(default_factory=list)
    max_batched_tokens: MaxBatchedTokens | None = None  # by device: default_max_batched_tokens

    @model_validator(mode="after")
    def _preferred_sizes_fit(self) -> BatchingSpec:
        if not preferred_sizes_fit(self.preferred_batch_sizes, self.max_batch_size):
            raise ValueError("every preferredBatchSizes entry must be between 1 and maxBatchSize")
        return self


class QueuePolicySpec(WireModel):
    """One priority level's queue policy (Triton's ``ModelQueuePolicy``)."""

    max_queue_size: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="Requests of this level that may wait (beyond, 429); unset: the pool's "
        "maxQueueSize. The pool's maxQueueSize still bounds all levels together.",
    )
    queue_timeout_seconds: float | None = Field(
        None, gt=0, le=3600, description="When timeoutAction applies; unset: the pool's."
    )
    timeout_action: TimeoutAction = Field(
        "REJECT",
        description="REJECT: 503 with Retry-After at the timeout. DELAY: the request stays "
        "queued behind every request that has not timed out, and gets 503 only after waiting "
        "twice queueTimeoutSeconds.",
    )


class AdmissionSpec(WireModel):
    """Limits the gateway holds across all of its replicas."""

    max_queue_size: int = Field(
        256, ge=0, le=1_000_000, description="Requests that may wait; beyond, 429 at once."
    )
    queue_timeout_seconds: float = Field(
        30, gt=0, le=3600, description="Longest a request waits for a slot; beyond, 503."
    )
    priority_levels: int = Field(
        MAX_PRIORITY_LEVELS,
        ge=1,
        le=MAX_PRIORITY_LEVELS,
        description="Levels clients may ask for (x-slotserve-priority 1..priorityLevels; 1 first).",
    )
    default_priority_level: int | None = Field(
        None,
        ge=1,
        le=MAX_PRIORITY_LEVELS,
        description="Level of a request without the header; unset: the gateway's default (5, "
        "capped at priorityLevels).",
    )
    priority_queue_policy: dict[int, QueuePolicySpec] = Field(
        default_factory=dict,
        description="Per-level queue policy, by level (Triton's priority_queue_policy).",
    )
    priority_aging_seconds: float | None = Field(
        None,
        ge=0,
        le=3600,
        description="Waiting this long is worth one level, so no level starves (a level-L "
        "request waits at most (L-1) x this plus the better-level requests already queued); "
        "unset: the gateway's (2 s).",
    )
    preempt_for_share: bool = Field(
        True,
        description="A request of a tenant holding fewer slots than its weighted share of the "
        "pool may preempt a running answer of a tenant holding more, when no slot is free, and "
        "a light tenant at its share may borrow one slot of a backlogged one (at most half an "
        "engine's slots outstanding on it; the answer resumes, recomputed). Never fires with "
        "one tenant.",
    )

    @model_validator(mode="after")
    def _levels_fit(self) -> AdmissionSpec:
        if self.default_priority_level is not None and (
            self.default_priority_level > self.priority_levels
        ):
            raise ValueError("defaultPriorityLevel must be at most priorityLevels")
        if any(level < 1 or level > self.priority_levels for level in self.priority_queue_policy):
            raise ValueError("every priorityQueuePolicy level must be between 1 and priorityLevels")
        return self


# A session key longer than this is refused (400); shorter ones are hashed before they reach
# Redis, so their text never becomes a key name.
MAX_SESSION_KEY_CHARS = 256


class RoutingSpec(WireModel):
    """How the gateway picks among engines with a free slot (docs/gateway.md)."""

    # The rule: the engine whose rows hold the longest prefix of the request, then the engine
    # that served its session last, then the least loaded; a preferred engine only while it is
    # within balance_threshold of the least loaded one. A request whose engine is full waits
    # for it (cache_wait_turnovers of that engine's slot turnovers, at most
    # cache_wait_milliseconds) while up to look_ahead requests behind it pass.

    prefix_aware: bool = Field(
        True,
        description="Prefer the engine whose cached rows hold the longest prefix of the request "
        "(chat messages, or blocks of the prompt); false: by load only.",
    )
    session_header: str = Field(
        "x-session-id",
        max_length=128,
        pattern=r"^[A-Za-z0-9-]*$",
        description="Request header whose value keeps a conversation on one engine while it has "
        'room; "" turns the header off.',
    )
    session_from_user: bool = Field(
        True, description="Use OpenAI's 'user' field as the session key when the header is absent."
    )
    balance_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An engine preferred for its cache or session takes the request only while "
        "the share of its slots in flight exceeds the least loaded engine's by at most this "
        "(0: only among the least loaded; 1: whenever it has a free slot).",
    )
    cache_wait_milliseconds: int = Field(
        20_000,
        ge=0,
        le=60_000,
        description="The longest a request may wait for the full engine holding its prefix while "
        "another has room (within balanceThreshold once a slot frees there), counted from the "
        "first time it did; requests behind it (lookAhead) are dispatched past it meanwhile. "
        "0: never waits (routed among the engines with room).",
    )
    cache_wait_turnovers: float = Field(
        3.0,
        ge=0,
        le=32,
        description="Within cacheWaitMilliseconds, a request waits at most this many of its "
        "engine's slot turnovers (the engine's mean request seconds over its slots: how often "
        "one of its slots frees), so a slow pool waits longer for a hit and a fast one less. "
        "0: always the whole cacheWaitMilliseconds.",
    )
    look_ahead: int = Field(
        8,
        ge=1,
        le=32,
        description="While the head of the queue waits for its engine, how many requests "
        "behind it (same priority level, in fair order) may be dispatched past it.",
    )
