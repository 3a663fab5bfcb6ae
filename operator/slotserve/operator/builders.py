"""Pure functions that turn an InferencePool into the Kubernetes objects that run it.

No I/O here: the handlers adopt (owner reference) and apply what these return, and tests call
them directly. The engine needs no ConfigMap: everything it takes is a command-line flag.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from slotserve.contracts.crd import ENGINE_PORT_NAME, POOL_LABEL
from slotserve.contracts.engine_argv import ENGINE_PORT, EngineLaunch, engine_argv
from slotserve.operator.models import GPU_RESOURCE, InferencePool, InferencePoolSpec

ENGINE_CONTAINER = "engine"
MODELS_MOUNT = "/models"
CACHE_MOUNT = "/cache"
RUN_AS_USER = 1000
PROBE_PERIOD_SECONDS = 5
# Time for the Service/gateway to stop sending new requests before SIGTERM reaches the engine.
PRE_STOP_SLEEP_SECONDS = 5
# Slack beyond the drain itself: process exit, flushing logs.
GRACE_SLACK_SECONDS = 10

COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = "slotserve-operator"

# The environment the operator gives every engine container. Read-only root filesystem: every
# library that writes must write into the volumes.
OPERATOR_ENV = (
    ("HOME", "/tmp"),
    ("XDG_CACHE_HOME", CACHE_MOUNT),
    ("HF_HOME", f"{CACHE_MOUNT}/huggingface"),
    ("TRITON_CACHE_DIR", f"{CACHE_MOUNT}/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_MOUNT}/inductor"),
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("PYTHONUNBUFFERED", "1"),
)
HF_ENDPOINT = "HF_ENDPOINT"  # the platform's model hub (setting hub_endpoint), when it names one
HF_TOKEN = "HF_TOKEN"  # from the pool's model.source.hub.tokenSecretRef
# Names only the operator sets: a pool's env may never set them (policy) and never wins (here).
OPERATOR_ENV_NAMES = frozenset({name for name, _ in OPERATOR_ENV} | {HF_ENDPOINT, HF_TOKEN})


def selector_labels(pool_name: str) -> dict[str, str]:
    """The labels that select a pool's engine pods (immutable in a Deployment)."""
    return {POOL_LABEL: pool_name, COMPONENT_LABEL: "engine"}


def selector_string(pool_name: str) -> str:
    """``selector_labels`` as a label selector string (status.selector, for the scale API)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(pool_name).items()))


def common_labels(pool: InferencePool) -> dict[str, str]:
    """Labels on every child: the selector labels plus the standard app.kubernetes.io set."""
    return {
        "app.kubernetes.io/name": "slotserve-engine",
        "app.kubernetes.io/instance": pool.metadata.name,
        "app.kubernetes.io/part-of": "slotserve",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(pool.metadata.name),
    }


def engine_device(spec: InferencePoolSpec) -> Literal["cpu", "cuda"]:
    """The engine's ``--device``: the pool's ``engine.device``, or for ``auto`` cuda when its
    resources ask for a GPU and cpu otherwise (a pod without a GPU limit may still see the
    node's GPUs: it must not use them)."""
    device = spec.engine.device
    if device != "auto":
        return device
    gpus = spec.engine.resources.limits.get(GPU_RESOURCE, 0)
    return "cpu" if str(gpus) in {"0", "+0", "-0"} else "cuda"


def engine_args(spec: InferencePoolSpec, model_arg: str) -> list[str]:
    """Arguments of ``slotserve engine`` for the pool's pods (``slotserve.contracts``)."""
    model = spec.model
    overrides = model.sampling_defaults.as_generation_config() if model.sampling_defaults else {}
    return engine_argv(
        EngineLaunch(
            model=model_arg,
            served_model_name=model.name,
            batching=spec.batching,
            max_model_len=model.max_model_len,
            dtype=model.dtype,
            drain_timeout_seconds=spec.engine.drain_timeout_seconds,
            generation_config=model.generation_config,
            tool_call_parser=model.tool_call_parser,
            override_generation_config=json.dumps(overrides, sort_keys=True) if overrides else None,
            # No flag for "none" (the engine's default): the args of existing pools stay as
            # they were, and so do their pods.
            quantization=None if model.quantization == "none" else model.quantization,
            device=engine_device(spec),
            prefix_cache_rows=spec.engine.prefix_cache_rows or None,
        )
    )


def _model_source(
    spec: InferencePoolSpec,
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(the engine's --model value, volumes, volume mounts) for the pool's model source."""
    source = spec.model.source
    if source.builtin is not None:
        # Baked into the image under its SLOTSERVE_HOME; resolved by name.
        return source.builtin, [], []
    if source.hub is not None:
        # Downloaded into the writable cache volume (HF_HOME) at start-up.
        return source.hub.id, [], []
    mount = {"name": "model", "mountPath": MODELS_MOUNT, "readOnly": True}
    if source.pvc is not None:
        volume = {
            "name": "model",
            "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
        }
        path = f"{MODELS_MOUNT}/{source.pvc.path}".rstrip("/") if source.pvc.path else MODELS_MOUNT
        return path, [volume], [mount]
    assert source.host_path is not None  # the model validator guarantees exactly one source
    volume = {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    return MODELS_MOUNT, [volume], [mount]


def _env(spec: InferencePoolSpec, hub_endpoint: str) -> list[dict[str, Any]]:
    """Ours first, then the pool's: a pool never overrides ours (the policy refuses such pools;
    here ours win even for a pool that reached the builder some other way)."""
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in OPERATOR_ENV]
    if hub_endpoint:
        env.append({"name": HF_ENDPOINT, "value": hub_endpoint})
    hub = spec.model.source.hub
    if hub is not None and hub.token_secret_ref is not None:
        secret_ref = {"name": hub.token_secret_ref.name, "key": hub.token_secret_ref.key}
        env.append({"name": HF_TOKEN, "valueFrom": {"secretKeyRef": secret_ref}})
    env += [
        {"name": var.name, "value": var.value}
        for var in spec.engine.env
        if var.name not in OPERATOR_ENV_NAMES
    ]
    return env


def _probe(path: str, *, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": ENGINE_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def build_container(
    pool: InferencePool, *, engine_image: str, hub_endpoint: str = ""
) -> dict[str, Any]:
    """The engine container: contract command and port, probes, hardened security context."""
    spec = pool.spec
    model_arg, _, model_mounts = _model_source(spec)
    # Quantities as strings: that is how the API server returns them, so re-reads compare equal.
    resources = {
        kind: {name: str(value) for name, value in amounts.items()}
        for kind, amounts in (
            ("requests", spec.engine.resources.requests),
            ("limits", spec.engine.resources.limits),
        )
        if amounts
    }
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image or engine_image,
        "command": ["slotserve"],
        "args": engine_args(spec, model_arg),
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(spec, hub_endpoint),
        "resources": resources,
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model_mounts,
        ],
        # Loading weights can take minutes: the startup probe holds liveness off until then.
        "startupProbe": _probe(
            "/ready",
            period=PROBE_PERIOD_SECONDS,
            failures=max(1, math.ceil(spec.engine.startup_timeout_seconds / PROBE_PERIOD_SECONDS)),
            timeout=2,
        ),
        "readinessProbe": _probe("/ready", period=PROBE_PERIOD_SECONDS, failures=2, timeout=2),
        "livenessProbe": _probe("/health", period=10, failures=3, timeout=5),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
        # An engine that cannot start (exit 2: no usable GPU, a setting this machine cannot
        # run) says why in its last log line; the kubelet keeps it as the termination message,
        # which the pool's status shows.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.engine.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.engine.image_pull_policy
    return container


def build_pod_spec(
    pool: InferencePool, *, engine_image: str, hub_endpoint: str = ""
) -> dict[str, Any]:
    """The engine pod spec: container, volumes, scheduling, grace period for draining."""
    spec = pool.spec
    _, model_volumes, _ = _model_source(spec)
    pod: dict[str, Any] = {
        "containers": [build_container(pool, engine_image=engine_image, hub_endpoint=hub_endpoint)],
        "volumes": [
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "cache", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
            *model_volumes,
        ],
        # Longer than preStop + drain, so Kubernetes never SIGKILLs a draining engine.
        "terminationGracePeriodSeconds": (
            PRE_STOP_SLEEP_SECONDS + spec.engine.drain_timeout_seconds + GRACE_SLACK_SECONDS
        ),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.engine.node_selector:
        pod["nodeSelector"] = dict(spec.engine.node_selector)
    if spec.engine.tolerations:
        pod["tolerations"] = [
            toleration.model_dump(by_alias=True, exclude_none=True)
            for toleration in spec.engine.tolerations
        ]
    if spec.engine.service_account_name:
        pod["serviceAccountName"] = spec.engine.service_account_name
    if spec.engine.priority_class_name:
        pod["priorityClassName"] = spec.engine.priority_class_name
    if spec.engine.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.engine.image_pull_secrets]
    return pod


def build_deployment(
    pool: InferencePool, *, engine_image: str, hub_endpoint: str = ""
) -> dict[str, Any]:
    """The engine Deployment of ``pool`` (without owner reference: the handler adopts it).

    ``hub_endpoint``: the platform's model hub (HF_ENDPOINT), empty = Hugging Face's own.
    """
    labels = common_labels(pool)
    template_metadata: dict[str, Any] = {"labels": labels}
    if pool.spec.engine.pod_annotations:
        template_metadata["annotations"] = dict(pool.spec.engine.pod_annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": pool.metadata.name,
            "namespace": pool.metadata.namespace,
            "labels": labels,
        },
        "spec": {
            "replicas": pool.spec.replicas,
            "selector": {"matchLabels": selector_labels(pool.metadata.name)},
            # Never drop below the desired capacity during a rollout; add one pod at a time.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": template_metadata,
                "spec": build_pod_spec(pool, engine_image=engine_image, hub_endpoint=hub_endpoint),
            },
        },
    }


def build_service(pool: InferencePool) -> dict[str, Any]:
    """A ClusterIP Service in front of the engine pods (port-forwarding, metrics scraping)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": pool.metadata.name,
            "namespace": pool.metadata.namespace,
            "labels": common_labels(pool),
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(pool.metadata.name),
            "ports": [
                {
                    "name": ENGINE_PORT_NAME,
                    "port": ENGINE_PORT,
                    "targetPort": ENGINE_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }
