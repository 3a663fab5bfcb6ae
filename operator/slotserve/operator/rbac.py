"""The Kubernetes API permissions the operator needs: the chart's ClusterRole must match these.

Every rule names exactly what the code calls: the operator's own objects, the children it
creates, the pods it watches for status, and what kopf itself needs (CRD discovery, namespace
watching, peering between replicas, events).
"""

from __future__ import annotations

from typing import Any

from slotserve.contracts.crd import GROUP, PLURAL

REQUIRED_RULES: list[dict[str, Any]] = [
    # The custom resource: watched, annotated with kopf's progress, finalizer-free, status written.
    {
        "apiGroups": [GROUP],
        "resources": [PLURAL],
        "verbs": ["get", "list", "watch", "patch", "update"],
    },
    {
        "apiGroups": [GROUP],
        "resources": [f"{PLURAL}/status"],
        "verbs": ["get", "patch", "update"],
    },
    # The built-in autoscaler sets replicas through the scale subresource, as an HPA does.
    {
        "apiGroups": [GROUP],
        "resources": [f"{PLURAL}/scale"],
        "verbs": ["get", "patch"],
    },
    # autoscaling.provider keda: the pool's ScaledObject (created, patched; deleted when the
    # pool stops asking for it).
    {
        "apiGroups": ["keda.sh"],
        "resources": ["scaledobjects"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    # gatewayAPI.inferencePool: the Gateway API InferencePool over the engines (deleted too
    # when switched off).
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    # The built-in autoscaler refuses to run beside another HPA of the same pool.
    {
        "apiGroups": ["autoscaling"],
        "resources": ["horizontalpodautoscalers"],
        "verbs": ["list"],
    },
    # Children: created, patched, watched for status. Deletion is the garbage collector's job.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    # The NetworkPolicy in front of each pool's engines: created, patched, watched (drift),
    # deleted when the operator runs without network policies.
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Engine pods: read-only, for readiness and endpoints.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # Events about pools (invalid specs, conflicts), posted by the operator and by kopf.
    {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    # kopf: discovers the CRDs it serves and watches namespaces when given patterns; the
    # operator reads KEDA's CRD (provider keda needs it installed).
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # kopf peering: replicas see each other so that only the highest-priority one is active.
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": ["get", "list", "watch", "patch"],
    },
]
