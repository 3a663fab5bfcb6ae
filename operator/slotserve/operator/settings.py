"""Typed settings of the operator (env prefix ``SLOTSERVE_OPERATOR_``; flags override them).

The policy settings default to the safe choice for a cluster many teams share: no hostPath model
sources, a NetworkPolicy in front of every pool's engines, a short list of environment variables
a pool may set, and no scheduling beyond the platform's own GPU nodes (no PriorityClass, no other
taint or node label, no KEDA server). The image and ServiceAccount allow-lists are off (empty)
unless a platform team sets them.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from slotserve.operator.builders import OPERATOR_ENV_NAMES
from slotserve.operator.models import ENV_NAME
from slotserve.operator.network import egress_rules
from slotserve.operator.policy import (
    DEFAULT_ALLOWED_ENV,
    DEFAULT_ALLOWED_NODE_SELECTOR_KEYS,
    DEFAULT_ALLOWED_TOLERATIONS,
    Policy,
    TolerationRule,
    image_allowed,
)

DEFAULT_ENGINE_IMAGE = "ghcr.io/slotserve/engine:0.1.0"
# The labels of the chart's gateway pods that every slotserve gateway carries.
DEFAULT_GATEWAY_POD_LABELS = {
    "app.kubernetes.io/component": "gateway",
    "app.kubernetes.io/part-of": "slotserve",
}
# The cluster DNS (CoreDNS/kube-dns keep the k8s-app=kube-dns label in kube-system).
DEFAULT_DNS_PEERS: list[dict[str, Any]] = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
]

CommaList = Annotated[list[str], NoDecode]
# JSON lists decoded by the validator below, so that an empty value means an empty list.
JsonList = Annotated[list[dict[str, Any]], NoDecode]


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
    allowed_env: CommaList = Field(
        default_factory=list,
        description="Environment variables pools may set beyond the built-in list "
        "(policy.DEFAULT_ALLOWED_ENV): exact names, comma list. Anything else is refused.",
    )
    allowed_priority_classes: CommaList = Field(
        default_factory=list,
        description="PriorityClasses pools may name (globs; '*' = any); empty = none.",
    )
    allowed_tolerations: Annotated[list[TolerationRule], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_TOLERATIONS),
        description="Tolerations pools may carry (JSON list of {key, effect}: key a glob, '*' "
        "= any taint; no effect = any effect); default: the GPU nodes' nvidia.com/gpu taint.",
    )
    allowed_node_selector_keys: CommaList = Field(
        default_factory=lambda: list(DEFAULT_ALLOWED_NODE_SELECTOR_KEYS),
        description="nodeSelector keys pools may use (globs; '*' = any); default: the GPU "
        "nodes' nvidia.com/gpu.present and nvidia.com/gpu.product.",
    )
    allowed_keda_server_addresses: CommaList = Field(
        default_factory=list,
        description="Prometheus URLs a KEDA-autoscaled pool may name (exact; '*' = any); "
        "empty = none.",
    )
    hub_endpoint: str = Field(
        "",
        pattern=r"^(https?://[^\s]+)?$",
        description="The model hub engine pods download from (HF_ENDPOINT, e.g. a mirror); "
        "empty = Hugging Face's own. Pools cannot set it.",
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
    engine_egress: bool = Field(
        False,
        description="Also restrict what engine pods reach (the pool's NetworkPolicy gets "
        "Egress rules): DNS and engine_egress_hub, nothing else.",
    )
    engine_egress_dns_peers: JsonList = Field(
        default_factory=lambda: copy.deepcopy(DEFAULT_DNS_PEERS),
        description="NetworkPolicyPeers of the cluster DNS, reached on port 53 (JSON list).",
    )
    engine_egress_hub: JsonList = Field(
        default_factory=list,
        description="NetworkPolicyEgressRules ({to, ports}) to the model hub the platform names "
        "(a mirror's pods, a proxy, an ipBlock) (JSON list); empty = only DNS.",
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

    @field_validator(
        "namespaces",
        "allowed_images",
        "allowed_service_accounts",
        "allowed_env",
        "allowed_priority_classes",
        "allowed_node_selector_keys",
        "allowed_keda_server_addresses",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator(
        "gateway_pod_labels",
        "scraper_peers",
        "allowed_tolerations",
        "engine_egress_dns_peers",
        "engine_egress_hub",
        mode="before",
    )
    @classmethod
    def _json(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str):
            empty: object = {} if info.field_name == "gateway_pod_labels" else []
            return json.loads(value) if value.strip() else empty
        return value

    @field_validator("allowed_env")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not re.fullmatch(ENV_NAME, name):
                raise ValueError(f"allowed_env: {name!r} is not an environment variable name")
        owned = sorted(set(names) & OPERATOR_ENV_NAMES)
        if owned:
            raise ValueError(
                f"allowed_env: {', '.join(owned)} are set by the operator; pools can never set them"
            )
        return names

    @model_validator(mode="after")
    def _default_image_allowed(self) -> OperatorSettings:
        if self.allowed_images and not image_allowed(self.engine_image, self.allowed_images):
            raise ValueError(
                f"engine_image {self.engine_image!r} is not in allowed_images: pools that name "
                "no image could never run"
            )
        return self

    def engine_egress_rules(self) -> list[dict[str, Any]] | None:
        """The egress rules of every pool's NetworkPolicy; None = egress is not restricted."""
        if not self.engine_egress:
            return None
        return egress_rules(self.engine_egress_dns_peers, self.engine_egress_hub)

    def policy(self) -> Policy:
        """The rules pools are checked against."""
        return Policy(
            engine_image=self.engine_image,
            allow_host_path=self.allow_host_path,
            allowed_images=tuple(self.allowed_images),
            allowed_service_accounts=tuple(self.allowed_service_accounts),
            allowed_env=DEFAULT_ALLOWED_ENV | set(self.allowed_env),
            allowed_priority_classes=tuple(self.allowed_priority_classes),
            allowed_tolerations=tuple(self.allowed_tolerations),
            allowed_node_selector_keys=tuple(self.allowed_node_selector_keys),
            allowed_keda_server_addresses=tuple(self.allowed_keda_server_addresses),
        )
