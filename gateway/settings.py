"""``GatewaySettings``: every knob of the gateway, from ``SLOTSERVE_GATEWAY_*`` or flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """Gateway settings (env prefix ``SLOTSERVE_GATEWAY_``; flags override the environment)."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_GATEWAY_", extra="ignore")

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port for the API, health and metrics.")
    config: Path | None = Field(None, description="Pool file (YAML) for file discovery.")
    redis_url: str | None = Field(
        None, description="Redis for admission shared by replicas; unset = in-process (1 replica)."
    )
    discovery: Literal["file", "kubernetes"] = Field("file", description="Where pools come from.")
    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Namespaces to watch (comma list); empty = all."
    )
    api_keys_file: Path | None = Field(
        None, description="File with one API key per line; unset = no authentication."
    )
    redis_prefix: str = Field("slotserve", min_length=1, description="Prefix of every Redis key.")
    lease_ttl_seconds: float = Field(
        10.0, gt=0.2, le=600, description="A dead replica's slots come back after this long."
    )
    default_priority: int = Field(5, ge=1, le=9, description="Priority without the header.")
    load_poll_interval_seconds: float = Field(
        0.25, gt=0, le=60, description="How often each engine's GET /load is read."
    )
    max_request_body_bytes: int = Field(1_048_576, ge=1024, description="Larger bodies get 413.")
    upstream_connect_timeout_seconds: float = Field(2.0, gt=0)
    upstream_timeout_seconds: float = Field(600.0, gt=0, description="Whole upstream request.")
    max_attempts: int = Field(3, ge=1, le=10, description="Engines tried before the first byte.")
    replica_id: str | None = Field(None, description="Name in Redis; default host-pid-random.")

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
