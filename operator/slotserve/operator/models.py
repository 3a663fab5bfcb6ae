"""The InferencePool custom resource as pydantic models: spec, status, and the parsed object.

These models are the single source of truth (the batching and admission parts are the shared
``slotserve.contracts.pool_spec``): ``slotserve.operator.crd`` generates the CRD's
openAPIV3Schema from them, the operator validates every object it reconciles with them, and the
gateway reads ``spec.model.name``, ``spec.batching`` and ``spec.admission`` (its engines come from
the EndpointSlices of the pool's Service; ``status.endpoints`` is information only).

Rules that the API server checks with CEL (``x-kubernetes-validations``) are mirrored here as
pydantic validators, so the operator rejects the same objects on clusters (or emulators) that do
not evaluate CEL.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StringConstraints, WithJsonSchema, model_validator

from slotserve.contracts.pool_spec import (
    DEFAULT_MAX_BATCH_SIZE,
    AdmissionSpec,
    BatchingSpec,
    PrefixCacheRows,
    RoutingSpec,
    WireModel,
    prefix_cache_rows_fit,
)
from slotserve.contracts.weights import WeightDType, WeightQuantization
from slotserve.operator.platform_models import AutoscalingSpec, GatewayAPISpec

# Models baked into the engine image (``slotserve model pull`` at image build time).
BuiltinModel = Literal["smollm2"]

# Kubernetes' own Quantity pattern (what controller-gen emits for resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[
    int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Label/annotation keys: [DNS subdomain prefix "/"] name. OpenAPI v3.0 cannot constrain map
# keys, so the CRD cannot check these; the operator does (InvalidSpec).
QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
GPU_RESOURCE = "nvidia.com/gpu"


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class SecretKeyRef(WireModel):
    """A key of a Secret in the pool's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The Secret's name.")
    key: str = Field("token", min_length=1, max_length=253, description="The key in the Secret.")


class HubSource(WireModel):
    """Weights downloaded from the Hugging Face Hub at start-up (needs egress)."""

    id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        max_length=200,
        description="Repository id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None, description="Secret holding a Hub token (for gated models), exposed as HF_TOKEN."
    )


class PvcSource(WireModel):
    """Weights on a PersistentVolumeClaim, mounted read-only."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": _cel(
            "!self.path.startsWith('/') && !self.path.contains('..')",
            "path must be relative to the volume and must not contain '..'",
        )
    }

    claim_name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="The PVC's name.")
    path: str = Field(
        "", max_length=1024, description="Folder inside the volume holding the model files."
    )

    @model_validator(mode="after")
    def _relative_path(self) -> PvcSource:
        if self.path.startswith("/") or ".." in self.path:
            raise ValueError("path must be relative to the volume and must not contain '..'")
        return self


class HostPathSource(WireModel):
    """Weights in a folder on the node (single-node clusters such as kind)."""

    path: str = Field(pattern=r"^/", max_length=1024, description="Absolute folder on the node.")


_ONE_SOURCE_RULE = (
    "[has(self.builtin), has(self.hub), has(self.pvc), has(self.hostPath)].filter(x, x).size() == 1"
)


class ModelSource(WireModel):
    """Where the weights come from: exactly one of builtin, hub, pvc, hostPath."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": _cel(
            _ONE_SOURCE_RULE, "exactly one of builtin, hub, pvc, hostPath must be set"
        )
    }

    builtin: BuiltinModel | None = Field(None, description="A model baked into the engine image.")
    hub: HubSource | None = None
    pvc: PvcSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        chosen = [self.builtin, self.hub, self.pvc, self.host_path]
        if sum(member is not None for member in chosen) != 1:
            raise ValueError("exactly one of builtin, hub, pvc, hostPath must be set")
        return self


class SamplingDefaults(WireModel):
    """Defaults for sampling fields a request leaves out, over the model's generation config."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    max_new_tokens: int | None = Field(None, ge=1)

    def as_generation_config(self) -> dict[str, float | int]:
        """generation_config.json keys (snake_case), for ``--override-generation-config``."""
        return self.model_dump(exclude_none=True, by_alias=False)


class ModelSpec(WireModel):
    """What to serve, and under which name."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        max_length=200,
        description='The name clients send in the OpenAI "model" field.',
    )
    source: ModelSource
    dtype: WeightDType = "auto"
    quantization: WeightQuantization = "none"
    max_model_len: int = Field(
        2048, ge=16, le=1_048_576, description="Longest prompt + completion, in tokens."
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="Sampling defaults for fields a request leaves out: auto (the model's "
        "generation_config.json, as vLLM's --generation-config auto) or none (OpenAI's).",
    )
    sampling_defaults: SamplingDefaults | None = Field(
        None, description="Overrides over the generation config (the engine's flag of that name)."
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="How the model writes tool calls; auto reads it from the chat template.",
    )


class ResourceRequirements(WireModel):
    """Compute resources of the engine container, e.g. limits {nvidia.com/gpu: 1}."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": _cel(
            f"!has(self.requests) || !('{GPU_RESOURCE}' in self.requests) || "
            f"(has(self.limits) && '{GPU_RESOURCE}' in self.limits && "
            f"self.limits['{GPU_RESOURCE}'] == self.requests['{GPU_RESOURCE}'])",
            f"{GPU_RESOURCE} requests must equal its limits (set limits only)",
        )
    }

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _gpu_requests_match_limits(self) -> ResourceRequirements:
        if GPU_RESOURCE in self.requests and (
            self.limits.get(GPU_RESOURCE) != self.requests[GPU_RESOURCE]
        ):
            raise ValueError(f"{GPU_RESOURCE} requests must equal its limits (set limits only)")
        return self


class Toleration(WireModel):
    """A pod toleration (same fields as Kubernetes' Toleration)."""

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)


class EnvVar(WireModel):
    """An extra environment variable of the engine container."""

    name: str = Field(pattern=ENV_NAME, max_length=253)
    value: str = ""


_CUDA_NEEDS_GPU_RULE = (
    "!has(self.device) || self.device != 'cuda' || (has(self.resources) && "
    f"has(self.resources.limits) && '{GPU_RESOURCE}' in self.resources.limits)"
)
_CUDA_NEEDS_GPU = f"device cuda needs resources.limits {GPU_RESOURCE}"


class EngineSpec(WireModel):
    """Knobs of the engine pods."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": _cel(_CUDA_NEEDS_GPU_RULE, _CUDA_NEEDS_GPU)
    }

    image: str | None = Field(
        None, min_length=1, description="Engine image; default: the operator's engineImage."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[Annotated[str, StringConstraints(pattern=DNS_SUBDOMAIN)]] = Field(
        default_factory=list, max_length=16, description="Names of image pull Secrets."
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description=f"Where the engine computes (its --device): auto = cuda when "
        f"resources.limits asks for {GPU_RESOURCE}, else cpu. An engine told cuda that finds "
        "no usable GPU exits 2 (the pool turns Degraded, EngineCannotStart) instead of "
        "falling back to the CPU.",
    )
    node_selector: dict[
        str, Annotated[str, StringConstraints(pattern=LABEL_VALUE, max_length=63)]
    ] = Field(default_factory=dict, max_length=64)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    service_account_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    priority_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    pod_annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    startup_timeout_seconds: int = Field(
        900, ge=10, le=86_400, description="How long loading the model may take before restart."
    )
    drain_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="How long a stopping engine may finish its requests."
    )
    prefix_cache_rows: PrefixCacheRows = 0

    @model_validator(mode="after")
    def _cuda_needs_a_gpu(self) -> EngineSpec:
        if self.device == "cuda" and GPU_RESOURCE not in self.resources.limits:
            raise ValueError(_CUDA_NEEDS_GPU)
        return self

    @model_validator(mode="after")
    def _qualified_keys(self) -> EngineSpec:
        for field, keys in (
            ("nodeSelector", self.node_selector),
            ("podAnnotations", self.pod_annotations),
        ):
            for key in keys:
                if len(key) > 316 or not QUALIFIED_NAME.match(key):
                    raise ValueError(f"{field} key {key!r} is not a valid label/annotation key")
        return self


# Defaulting runs before CEL, but a rule must still read a spec written without the sections.
_ROWS_HOLD_THE_SLOTS_RULE = (
    "!has(self.engine) || !has(self.engine.prefixCacheRows) || self.engine.prefixCacheRows == 0"
    " || self.engine.prefixCacheRows >= (has(self.batching) && has(self.batching.maxBatchSize)"
    f" ? self.batching.maxBatchSize : {DEFAULT_MAX_BATCH_SIZE})"
)
_ROWS_HOLD_THE_SLOTS = "engine.prefixCacheRows must be 0 or at least batching.maxBatchSize"


class InferencePoolSpec(WireModel):
    """The desired state: a model served by a number of engine pods with one batching policy."""

    model_config: ClassVar = WireModel.model_config | {
        "json_schema_extra": _cel(_ROWS_HOLD_THE_SLOTS_RULE, _ROWS_HOLD_THE_SLOTS)
    }

    model: ModelSpec
    replicas: int = Field(1, ge=0, le=1000, description="Engine pods (also set by kubectl scale).")
    engine: EngineSpec = Field(default_factory=EngineSpec)
    # The shared model checks this rule in a validator; the API server needs it as CEL.
    batching: BatchingSpec = Field(
        default_factory=BatchingSpec,
        json_schema_extra=_cel(
            "!has(self.preferredBatchSizes) || "
            "self.preferredBatchSizes.all(s, s >= 1 && s <= self.maxBatchSize)",
            "every preferredBatchSizes entry must be between 1 and maxBatchSize",
        ),
    )
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    gateway_api: GatewayAPISpec = Field(
        default_factory=GatewayAPISpec,
        alias="gatewayAPI",
        description="Also expose the engines to Gateway API inference routing (bypasses "
        "slotserve's admission).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Scale replicas from the admission queue (spec.replicas is then set "
        "by the operator or KEDA). Leave unset to use kubectl scale or your own HPA.",
    )

    @model_validator(mode="after")
    def _rows_hold_the_slots(self) -> InferencePoolSpec:
        if not prefix_cache_rows_fit(self.engine.prefix_cache_rows, self.batching.max_batch_size):
            raise ValueError(_ROWS_HOLD_THE_SLOTS)
        return self


ConditionType = Literal["Ready", "Progressing", "Degraded", "Saturated"]


class Condition(WireModel):
    """One observation about the pool, Kubernetes-style (metav1.Condition's fields)."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32_768)
    last_transition_time: str = Field(
        description="RFC 3339 time of the last status change.",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(None, ge=0)


class TenantAdmission(WireModel):
    """One tenant's admission in the pool over the last minute."""

    admitted_per_minute: int = Field(0, ge=0, description="Requests given a slot, last minute.")
    queue_wait_seconds_p95: float | None = Field(
        None, ge=0, description="95th percentile of its queue waits in the last minute."
    )


class AdmissionStatus(WireModel):
    """The pool's admission state, summed over every gateway replica (read from their Redis)."""

    queued: int = Field(0, ge=0, description="Requests waiting in the shared queue.")
    in_flight: int = Field(0, ge=0, description="Requests holding a slot on an engine.")
    slots_total: int = Field(
        0, ge=0, description="Slots of the ready engines (readyReplicas x maxBatchSize)."
    )
    admitted_per_minute: int = Field(0, ge=0, description="Requests given a slot, last minute.")
    rejected_per_minute: dict[str, int] = Field(
        default_factory=dict,
        description="Requests refused in the last minute, by reason (queue_full, ...).",
    )
    queue_wait_seconds_p95: float | None = Field(
        None, ge=0, description="95th percentile of queue waits in the last minute."
    )
    tenants: dict[str, TenantAdmission] = Field(
        default_factory=dict,
        description="Per tenant (the gateways' keys file), the 16 most admitted in the last "
        "minute: what each got of the pool and how long it waited (its weighted fair share).",
    )
    prefix_hit_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Of the requests routed by prefix in the last minute, the share sent to an "
        "engine whose cache held a prefix of them (routing.prefixAware).",
    )
    saturated: bool = Field(
        False,
        description="Every slot busy with requests waiting, or the "
        "queue refused requests as full in the last minute.",
    )
    observed_time: str = Field(
        description="RFC 3339 time of the Redis read these numbers come from.",
        json_schema_extra={"format": "date-time"},
    )


class InferencePoolStatus(WireModel):
    """What the operator observed; endpoints are for people (the gateway uses EndpointSlices)."""

    observed_generation: int | None = Field(None, ge=0)
    replicas: int = Field(0, ge=0, description="Engine pods that exist (for the scale API).")
    ready_replicas: int = Field(0, ge=0)
    selector: str = Field("", description="Label selector of the engine pods (for the scale API).")
    endpoints: list[str] = Field(
        default_factory=list, description='"IP:PORT" of every ready engine pod.'
    )
    conditions: list[Condition] = Field(default_factory=list)
    admission: AdmissionStatus | None = Field(
        None, description="Admission state from the gateways' Redis (operator redisUrl set)."
    )
    cold_start_seconds: float | None = Field(
        None,
        ge=0,
        description="Seconds from an engine pod's creation to Ready, the longest of the last "
        "few measured: the gateways' Retry-After for requests held while no engine is ready.",
    )


class ObjectMeta(WireModel):
    """The few metadata fields the operator uses."""

    model_config: ClassVar = WireModel.model_config | {"extra": "ignore"}

    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 1
    labels: dict[str, str] = Field(default_factory=dict)


class InferencePool(WireModel):
    """A parsed InferencePool object: metadata plus validated spec."""

    model_config: ClassVar = WireModel.model_config | {"extra": "ignore"}

    metadata: ObjectMeta
    spec: InferencePoolSpec

    @classmethod
    def from_body(cls, body: Any) -> InferencePool:
        """Parse an API object (a dict or kopf's Body); raises pydantic.ValidationError."""
        return cls.model_validate({"metadata": dict(body["metadata"]), "spec": dict(body["spec"])})
