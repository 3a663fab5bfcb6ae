"""The platform parts of the InferencePool spec: autoscaling and Gateway API interop.

Kept apart from ``models`` (which imports them) so that each file stays readable; the same
rules hold: CEL rules in the schema are mirrored as pydantic validators.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from slotserve.contracts.pool_spec import WireModel

# The same pattern as models.DNS_SUBDOMAIN (models imports this module, not the reverse).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class KedaSpec(WireModel):
    """Where KEDA reads the gateways' metrics (provider: keda)."""

    server_address: str = Field(
        pattern=r"^https?://[^\s]+$",
        max_length=2048,
        description="Prometheus that scrapes the gateways, e.g. http://prometheus.monitoring:9090.",
    )
    polling_interval_seconds: int = Field(
        15, ge=1, le=3600, description="How often KEDA runs the query (its pollingInterval)."
    )


class AutoscalingSpec(WireModel):
    """Replicas from the admission queue: desired = ceil((queued + in-flight) / target)."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "minReplicas must not exceed maxReplicas",
                },
                {
                    "rule": "self.provider != 'keda' || has(self.keda)",
                    "message": "provider keda needs keda.serverAddress",
                },
            ]
        }
    }

    provider: Literal["builtin", "keda"] = Field(
        "builtin",
        description="builtin: the operator writes the scale subresource; keda: the operator "
        "renders a KEDA ScaledObject against it instead.",
    )
    min_replicas: int = Field(1, ge=0, le=1000, description="0 lets an idle pool scale to zero.")
    max_replicas: int = Field(ge=1, le=1000, description="Never more engine pods than this.")
    target_requests_per_replica: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Queued + in-flight requests one replica should carry; default: "
        "batching.maxBatchSize (its slots).",
    )
    scale_up_window_seconds: int = Field(
        0, ge=0, le=3600, description="Scale up to the lowest recommendation of this window."
    )
    scale_down_window_seconds: int = Field(
        300, ge=0, le=3600, description="Scale down to the highest recommendation of this window."
    )
    keda: KedaSpec | None = None

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must not exceed maxReplicas")
        if self.provider == "keda" and self.keda is None:
            raise ValueError("provider keda needs keda.serverAddress")
        return self


class EndpointPickerRef(WireModel):
    """The Endpoint Picker (EPP) Service that a Gateway API InferencePool names."""

    name: str = Field(
        pattern=DNS_SUBDOMAIN,
        max_length=253,
        description="The EPP Service, in the pool's namespace.",
    )
    port_number: int = Field(9002, ge=1, le=65535, description="The EPP's gRPC port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What the Gateway does when the EPP does not answer."
    )


class GatewayInferencePoolSpec(WireModel):
    """An owned inference.networking.k8s.io/v1 InferencePool over the engine pods."""

    enabled: bool = Field(False, description="Create it (needs the Gateway API inference CRDs).")
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        None, description="The EPP to use; default: the Service <pool>-epp on port 9002."
    )


class GatewayAPISpec(WireModel):
    """Interop with the Kubernetes Gateway API inference extension."""

    inference_pool: GatewayInferencePoolSpec = Field(default_factory=GatewayInferencePoolSpec)
