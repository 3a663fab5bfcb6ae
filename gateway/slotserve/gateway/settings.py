"""``GatewaySettings``: every knob of the gateway, from ``SLOTSERVE_GATEWAY_*`` or flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
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
    model_namespaces: Annotated[dict[str, list[str]], NoDecode] = Field(
        default_factory=dict,
        description="Which namespaces' pools may serve which model names (kubernetes "
        "discovery): 'llama-*=platform,ml;smollm2=platform' (a glob, then namespaces; the "
        "first matching glob decides; a name none matches: any namespace).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File with one API key per line (reloaded when it changes); unset = no "
        "authentication. A file without any key is refused at start-up.",
    )
    api_keys_poll_interval_seconds: float = Field(
        2.0, gt=0, le=300, description="How often the API keys file is checked for changes."
    )
    metrics_require_api_key: bool = Field(
        False, description="Serve /metrics only with a valid API key (needs api_keys_file)."
    )
    redis_prefix: str = Field("slotserve", min_length=1, description="Prefix of every Redis key.")
    lease_ttl_seconds: float = Field(
        10.0, gt=0.2, le=600, description="A dead replica's slots come back after this long."
    )
    default_priority: int = Field(
        5,
        ge=1,
        le=9,
        description="Priority without the header, for pools without defaultPriorityLevel.",
    )
    priority_aging_seconds: float = Field(
        2.0,
        ge=0,
        le=3600,
        description="Waiting this long is worth one priority level (no level starves), for "
        "pools without priorityAgingSeconds.",
    )
    load_poll_interval_seconds: float = Field(
        0.25, gt=0, le=60, description="How often each engine's GET /load is read."
    )
    max_request_body_bytes: int = Field(1_048_576, ge=1024, description="Larger bodies get 413.")
    body_read_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="A request body must arrive within this long (408)."
    )
    max_json_nodes: int = Field(
        200_000,
        ge=100,
        description="Most JSON values in a request body (a token-id prompt counts one per id); "
        "more: 400 before it is parsed.",
    )
    max_json_depth: int = Field(
        64, ge=4, le=900, description="Deepest nesting of a request body's JSON; deeper: 400."
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=1_048_576,
        description="Bytes this replica's waiting and streaming requests may hold (bodies, "
        "buffered answers); past it 503 with Retry-After. Unset: memory_budget_fraction of the "
        "memory the container may still use at start (its cgroup limit less its working set).",
    )
    memory_budget_fraction: float = Field(
        0.5, gt=0, le=1, description="The default memory budget's share of that memory."
    )
    upstream_connect_timeout_seconds: float = Field(2.0, gt=0)
    upstream_read_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="Longest silence from an engine: before its answer (non-streaming) or "
        "between two stream chunks. Not a total, so long generations are never cut.",
    )
    max_attempts: int = Field(3, ge=1, le=10, description="Engines tried before the first byte.")
    max_upstream_answer_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Longest whole (non-streaming) answer taken from an engine; longer: 502 and "
        "the engine is marked down.",
    )
    shutdown_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=86_400,
        description="After SIGTERM (the listener closed), how long running requests and streams "
        "may take to finish before their connections are cut.",
    )
    replica_id: str | None = Field(None, description="Name in Redis; default host-pid-random.")
    hold_at_zero: bool = Field(
        True,
        description="A request for a pool with no ready engine waits in the queue (bounded by "
        "the pool's queue size and timeout) until one is up; off: 503 no_ready_endpoint at once.",
    )
    deadline_refusal: bool = Field(
        False,
        description="Refuse at once (429 deadline, Retry-After) a request whose predicted queue "
        "wait (the places ahead of it at the measured drain) is longer than it may wait (its "
        "x-slotserve-deadline-ms or the queue timeout), instead of letting it time out in the "
        "queue; never before the drain has been measured.",
    )
    cold_start_seconds: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="Seconds an engine takes to start, for pools that state none (the pools "
        "file's coldStartSeconds, the InferencePool's measured status.coldStartSeconds): the "
        "Retry-After of a request held for a pool at zero that timed out.",
    )

    @model_validator(mode="after")
    def _metrics_auth_needs_keys(self) -> GatewaySettings:
        if self.metrics_require_api_key and self.api_keys_file is None:
            raise ValueError("metrics_require_api_key needs api_keys_file")
        return self

    @field_validator("model_namespaces", mode="before")
    @classmethod
    def _parse_model_namespaces(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        parsed: dict[str, list[str]] = {}
        for entry in filter(None, (part.strip() for part in value.split(";"))):
            pattern, sep, namespaces = entry.partition("=")
            if not sep or not pattern.strip():
                raise ValueError(f"model_namespaces entry {entry!r} is not GLOB=NS1,NS2")
            parsed[pattern.strip()] = [ns.strip() for ns in namespaces.split(",") if ns.strip()]
        return parsed

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value
