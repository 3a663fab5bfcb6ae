"""``autoscaling.provider: keda``: a KEDA ScaledObject that scales the pool's scale subresource
from the gateways' Prometheus metrics, with the same target as the built-in scaler.

The query is the built-in scaler's demand, from ``slotserve.gateway.http.metrics``: the shared queue
(every gateway replica reports the whole queue, so ``max``), plus the requests in flight (each
replica reports its own, so ``sum``), plus one while requests are refused for lack of an engine
(so a pool at zero wakes up). KEDA's prometheus trigger divides it by ``threshold`` per replica
(metricType AverageValue); ``activationThreshold`` 0 wakes the pool from zero on any demand.
"""

from __future__ import annotations

from typing import Any

from slotserve.contracts.crd import API_VERSION, KIND
from slotserve.operator.builders import COMPONENT_LABEL, common_labels
from slotserve.operator.models import InferencePool

KEDA_GROUP = "keda.sh"
KEDA_VERSION = "v1alpha1"
SCALED_OBJECTS = "scaledobjects"
KEDA_CRD = f"{SCALED_OBJECTS}.{KEDA_GROUP}"


def demand_query(model: str) -> str:
    """PromQL for queued + in-flight requests of one pool (the gateways' pool label)."""
    pool = model.replace("\\", "\\\\").replace('"', '\\"')
    return (
        f'(max(slotserve_gateway_queue_size{{pool="{pool}"}}) or vector(0))'
        f' + (sum(slotserve_gateway_inflight_requests{{pool="{pool}"}}) or vector(0))'
        f" + (clamp_max(ceil(sum(rate(slotserve_gateway_rejected_total"
        f'{{pool="{pool}",reason="no_ready_endpoint"}}[1m]))), 1) or vector(0))'
    )


def build_scaled_object(pool: InferencePool) -> dict[str, Any]:
    """The ScaledObject of ``pool`` (its autoscaling.provider must be keda)."""
    autoscaling = pool.spec.autoscaling
    if autoscaling is None or autoscaling.keda is None:
        raise ValueError("the pool has no keda autoscaling")
    name, namespace = pool.metadata.name, pool.metadata.namespace
    target = autoscaling.target_requests_per_replica or pool.spec.batching.max_batch_size
    return {
        "apiVersion": f"{KEDA_GROUP}/{KEDA_VERSION}",
        "kind": "ScaledObject",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**common_labels(pool), COMPONENT_LABEL: "autoscaler"},
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "pollingInterval": autoscaling.keda.polling_interval_seconds,
            # KEDA's cooldownPeriod only governs the last step to zero; the HPA's behaviour
            # below governs every other step down.
            "cooldownPeriod": autoscaling.scale_down_window_seconds,
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": autoscaling.scale_up_window_seconds
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": autoscaling.scale_down_window_seconds
                        },
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": autoscaling.keda.server_address,
                        "query": demand_query(pool.spec.model.name),
                        "threshold": str(target),
                        "activationThreshold": "0",
                    },
                }
            ],
        },
    }
