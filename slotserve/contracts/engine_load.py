"""The engine's ``GET /load`` body: what the gateway reads of each engine several times a second.

The engine serves an :class:`EngineLoadReport`; the gateway parses the body with it. Fields a
newer engine adds are ignored, so gateways and engines of neighbouring versions can mix.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from slotserve.contracts.pool_spec import DEFAULT_POLICY, BatchingPolicy

# Keys one report may carry (17 bytes each in JSON: ~35 KB at most); an engine with many slots
# reports fewer keys per row.
MAX_REPORTED_PREFIX_KEYS = 2048
# A row unused this long is as cold as rows get (prefix_row_idle_ms is reported up to it).
MAX_ROW_IDLE_MS = 3_600_000


class EngineLoadReport(BaseModel):
    """One engine's slots and queue right now."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", description="The name the engine serves.")
    policy: BatchingPolicy = DEFAULT_POLICY
    slots_total: int = Field(
        description="The slots the gateway may fill: max_batch_size, or fewer when the KV "
        "memory holds fewer rows.",
    )
    slots_free: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    draining: bool = Field(False, description="Finishing its requests before it stops.")
    mean_request_seconds: float = Field(
        0.0, description="Mean seconds per finished request (the gateway's first Retry-After)."
    )
    prefix_keys: list[str] = Field(
        default_factory=list,
        max_length=MAX_REPORTED_PREFIX_KEYS,
        description="The prefix keys (contracts.prefix_keys) of what the engine's slot rows hold "
        "now: the gateway routes a request whose chain they match here (prefix-aware routing).",
    )
    prefix_cache_rows: int = Field(
        0,
        description="The engine's KV rows: its slots, and any spare rows beyond them that keep "
        "finished prefixes for reuse (the engine's prefix_cache_rows); 0 from older engines.",
    )
    prefix_rows_free: int = Field(
        0,
        description="KV rows that hold nothing yet, less the requests waiting for a slot: the "
        "gateway sends a request whose prefix no engine holds where it evicts nobody's; 0 from "
        "older engines.",
    )
    prefix_row_idle_ms: int = Field(
        0,
        ge=0,
        le=MAX_ROW_IDLE_MS,
        description="With no row free of a prefix (prefix_rows_free 0): how long the row that a "
        "new prefix would take next (the least recently used, after the waiting requests' own) "
        "has sat unused, in milliseconds, at most MAX_ROW_IDLE_MS; 0 when none or from older "
        "engines. The gateway sends a new prefix where it evicts the coldest row.",
    )
    # Choices made at load (e.g. linear_backend) and what each cost; for people, not gateways.
    calibrations: list[dict[str, object]] = Field(default_factory=list)
    kv_cache_dtype: str = Field(
        "", description="What the KV cache stores keys and values in; empty from older engines."
    )
    max_batched_tokens: int = Field(
        0,
        description="The per-step token budget in force (the setting, or the device's default: "
        "1024 on CPU, 2048 on GPU); 0 from older engines.",
    )
