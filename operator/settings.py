"""Typed settings of the operator (env prefix ``SLOTSERVE_OPERATOR_``; flags override them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_ENGINE_IMAGE = "ghcr.io/slotserve/engine:0.1.0"


class OperatorSettings(BaseSettings):
    """Everything ``slotserve operator`` reads at start-up."""

    model_config = SettingsConfigDict(env_prefix="SLOTSERVE_OPERATOR_", extra="ignore")

    namespaces: Annotated[list[str], NoDecode] = Field(
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

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value
