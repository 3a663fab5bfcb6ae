"""Typed settings of the operator (env prefix ``SLOTSERVE_OPERATOR_``; flags override them).

The policy settings default to the safe choice: no hostPath model sources, a NetworkPolicy in
front of every pool's engines. The allow-lists are off (empty) unless a platform team sets them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from slotserve.operator.policy import image_allowed

DEFAULT_ENGINE_IMAGE = "ghcr.io/slotserve/engine:0.1.0"
# The labels of the chart's gateway pods that every slotserve gateway carries.
DEFAULT_GATEWAY_POD_LABELS = {
    "app.kubernetes.io/component": "gateway",
    "app.kubernetes.io/part-of": "slotserve",
}

CommaList = Annotated[list[str], NoDecode]


class OperatorSettings(BaseSettings):
    """Everything ``slotserve operator`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_OPERATOR_", extra="ignore")

    namespaces: CommaList = Field(
        default_factory=list,
        description="Namespaces to watch (comma list); empty = the whole cluster.",
    )
    engine_image: str = Field(
        DEFAULT_ENGINE_IMAGE, min_length=1, description="Engine image when a pool names none."
    )
    health_port: int = Field(8080, ge=1, le=65535, description="Port of GET /healthz.")
    peering_name: str = Field(
        "",
        description=(
            "kopf peering object shared by the operator replicas (needs kopf's peering CRDs); "
            "empty = use the 'default' peering if it exists, else run standalone."
        ),
    )
    priority: int | None = Field(
        None,
        description="Peering priority; default: random, so exactly one replica is active.",
    )
    # --- policy -------------------------------------------------------------------------------
    allow_host_path: bool = Field(
        False,
        description="Accept hostPath model sources (a node folder mounted into the engine pods; "
        "such pods fail the 'restricted' Pod Security Standard). Off: the pool is Degraded.",
    )
    allowed_images: CommaList = Field(
        default_factory=list,
        description="Engine images pools may use: glob patterns over the full reference "
        "(e.g. ghcr.io/slotserve/*); empty = any image.",
    )
    allowed_service_accounts: CommaList = Field(
        default_factory=list,
        description="ServiceAccounts engine pods may run as: 'name' or 'namespace/name' glob "
        "patterns; empty = any. Pools that name none always pass.",
    )
    # --- network ------------------------------------------------------------------------------
    network_policy: bool = Field(
        True,
        description="Create a NetworkPolicy per pool: engines take traffic only from "
        "the gateway pods and the scrapers below.",
    )
    gateway_namespace: str = Field(
        "", description="Namespace of the gateway pods; empty = the pool's own namespace."
    )
    gateway_pod_labels: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_GATEWAY_POD_LABELS),
        min_length=1,
        description="Labels that select the gateway pods (JSON object).",
    )
    scraper_peers: list[dict[str, Any]] = Field(
        default_factory=list,
        description="More NetworkPolicyPeers allowed to reach the engine port, e.g. Prometheus "
        "(JSON list).",
    )
    # --- admission status and autoscaling (the gateways' Redis) --------------------------------
    redis_url: str | None = Field(
        None,
        description="The Redis the gateways share (read-only here): status.admission and the "
        "built-in autoscaler; unset = neither.",
    )
    redis_password: SecretStr | None = Field(
        None, description="Redis password, when the URL carries none."
    )
    redis_prefix: str = Field(
        "slotserve", min_length=1, description="Key prefix: the gateways' redis_prefix."
    )
    admission_refresh_seconds: float = Field(
        5.0, ge=0.1, le=300, description="How often the admission state is read from Redis."
    )
    admission_max_age_seconds: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="status.admission is rewritten at least this often while Redis answers "
        "(fresh observedTime), even when nothing moved beyond the thresholds.",
    )
    # --- self-healing -------------------------------------------------------------------------
    resync_seconds: float = Field(
        300, ge=1, le=86_400, description="Every pool is re-applied this often (drift repair)."
    )

    @field_validator("namespaces", "allowed_images", "allowed_service_accounts", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("gateway_pod_labels", "scraper_peers", mode="before")
    @classmethod
    def _json(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            empty: object = {} if info.field_name == "gateway_pod_labels" else []
            return json.loads(value) if value.strip() else empty
        return value

    @model_validator(mode="after")
    def _default_image_allowed(self) -> OperatorSettings:
        if self.allowed_images and not image_allowed(self.engine_image, self.allowed_images):
            raise ValueError(
                f"engine_image {self.engine_image!r} is not in allowed_images: pools that name "
                "no image could never run"
            )
        return self
