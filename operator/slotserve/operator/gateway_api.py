"""``spec.gatewayAPI.inferencePool``: an ``inference.networking.k8s.io/v1`` InferencePool (the
Kubernetes Gateway API inference extension's kind) selecting the pool's engine pods, so any
conformant Gateway can route to them through an HTTPRoute and an Endpoint Picker.

Such traffic reaches the engines directly: slotserve's shared queue, slot limits and priorities
do not apply to it (the engines still refuse work beyond their slots with 429).
"""

from __future__ import annotations

from typing import Any

from slotserve.operator.builders import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    common_labels,
    selector_labels,
)
from slotserve.operator.models import InferencePool

GATEWAY_GROUP = "inference.networking.k8s.io"
GATEWAY_VERSION = "v1"
GATEWAY_PLURAL = "inferencepools"
GATEWAY_CRD = f"{GATEWAY_PLURAL}.{GATEWAY_GROUP}"
DEFAULT_EPP_PORT = 9002


def build_gateway_inference_pool(pool: InferencePool) -> dict[str, Any]:
    """The Gateway API InferencePool of ``pool``: same name, the engine pods, port 8000."""
    name = pool.metadata.name
    ref = pool.spec.gateway_api.inference_pool.endpoint_picker_ref
    return {
        "apiVersion": f"{GATEWAY_GROUP}/{GATEWAY_VERSION}",
        "kind": "InferencePool",
        "metadata": {
            "name": name,
            "namespace": pool.metadata.namespace,
            "labels": {**common_labels(pool), COMPONENT_LABEL: "gateway-api"},
        },
        "spec": {
            # The Deployment's own selector: exactly the engine pods of this pool.
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": ENGINE_PORT}],
            # Required by v1. Default: the EPP the extension's chart deploys as <pool>-epp.
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": ref.name if ref else f"{name}-epp",
                "portNumber": ref.port_number if ref else DEFAULT_EPP_PORT,
                "failureMode": ref.failure_mode if ref else "FailClose",
            },
        },
    }
