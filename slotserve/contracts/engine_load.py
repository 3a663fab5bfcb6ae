"""The engine's ``GET /load`` body: what the gateway reads of each engine several times a second.

The engine serves an :class:`EngineLoadReport`; the gateway parses the body with it. Fields a
newer engine adds are ignored, so gateways and engines of neighbouring versions can mix.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from slotserve.contracts.pool_spec import DEFAULT_POLICY, BatchingPolicy


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
    # Choices made at load (e.g. linear_backend) and what each cost; for people, not gateways.
    calibrations: list[dict[str, object]] = Field(default_factory=list)
