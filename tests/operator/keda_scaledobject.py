"""A check of KEDA ScaledObjects, written from KEDA's documentation (not copied from KEDA):

- "ScaledObject specification" (keda.sh/docs/2.x/reference/scaledobject-spec): the fields of
  ``spec`` and ``scaleTargetRef`` (``name`` mandatory, the target must be in the same namespace;
  a custom resource target needs a ``/scale`` subresource), ``idleReplicaCount`` below
  ``minReplicaCount``, ``advanced.horizontalPodAutoscalerConfig.behavior`` being the HPA's
  behaviour (``stabilizationWindowSeconds`` 0..3600, as autoscaling/v2 allows);
- "Prometheus scaler" (keda.sh/docs/2.x/scalers/prometheus): ``serverAddress``, ``query`` and
  ``threshold`` required, the other documented parameters optional, every value a string;
- triggers' ``metricType``: AverageValue (default), Value or Utilization.
"""

from __future__ import annotations

from typing import Any

SPEC_FIELDS = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
TARGET_FIELDS = {"apiVersion", "kind", "name", "envSourceContainerName"}
ADVANCED_FIELDS = {
    "restoreToOriginalReplicaCount",
    "horizontalPodAutoscalerConfig",
    "scalingModifiers",
}
HPA_CONFIG_FIELDS = {"name", "behavior"}
BEHAVIOR_RULE_FIELDS = {"stabilizationWindowSeconds", "selectPolicy", "policies"}
TRIGGER_FIELDS = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
METRIC_TYPES = {"AverageValue", "Value", "Utilization"}
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_OPTIONAL = {
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "queryParameters",
    "unsafeSsl",
    "authModes",
}
COUNT_FIELDS = ("pollingInterval", "cooldownPeriod", "initialCooldownPeriod", "minReplicaCount")


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def scaled_object_problems(obj: dict[str, Any], namespace: str) -> list[str]:
    """Everything in ``obj`` that KEDA's documented ScaledObject spec does not allow."""
    problems = []
    if obj.get("apiVersion") != "keda.sh/v1alpha1" or obj.get("kind") != "ScaledObject":
        problems.append("not a keda.sh/v1alpha1 ScaledObject")
    if obj.get("metadata", {}).get("namespace") != namespace:
        problems.append("the ScaledObject must be in its target's namespace")
    spec = obj.get("spec", {})
    problems += [f"unknown spec field {k}" for k in set(spec) - SPEC_FIELDS]
    target = spec.get("scaleTargetRef", {})
    problems += [f"unknown scaleTargetRef field {k}" for k in set(target) - TARGET_FIELDS]
    if not target.get("name"):
        problems.append("scaleTargetRef.name is mandatory")
    for name in COUNT_FIELDS:
        if name in spec and not (isinstance(spec[name], int) and spec[name] >= 0):
            problems.append(f"{name} must be a non-negative integer")
    if not (
        isinstance(spec.get("maxReplicaCount", 100), int) and spec.get("maxReplicaCount", 100) >= 1
    ):
        problems.append("maxReplicaCount must be a positive integer")
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        problems.append("minReplicaCount exceeds maxReplicaCount")
    if "idleReplicaCount" in spec and spec["idleReplicaCount"] >= spec.get("minReplicaCount", 0):
        problems.append("idleReplicaCount must be less than minReplicaCount")
    advanced = spec.get("advanced", {})
    problems += [f"unknown advanced field {k}" for k in set(advanced) - ADVANCED_FIELDS]
    hpa = advanced.get("horizontalPodAutoscalerConfig", {})
    problems += [
        f"unknown horizontalPodAutoscalerConfig field {k}" for k in set(hpa) - HPA_CONFIG_FIELDS
    ]
    for direction, rule in (hpa.get("behavior") or {}).items():
        if direction not in {"scaleUp", "scaleDown"}:
            problems.append(f"unknown behavior {direction}")
        problems += [f"unknown {direction} field {k}" for k in set(rule) - BEHAVIOR_RULE_FIELDS]
        window = rule.get("stabilizationWindowSeconds", 0)
        if not (isinstance(window, int) and 0 <= window <= 3600):
            problems.append(f"{direction}.stabilizationWindowSeconds must be 0..3600")
    triggers = spec.get("triggers")
    if not isinstance(triggers, list) or not triggers:
        return [*problems, "triggers must be a non-empty list"]
    for trigger in triggers:
        problems += [f"unknown trigger field {k}" for k in set(trigger) - TRIGGER_FIELDS]
        if trigger.get("metricType", "AverageValue") not in METRIC_TYPES:
            problems.append(f"metricType {trigger.get('metricType')} is not one of {METRIC_TYPES}")
        metadata = trigger.get("metadata", {})
        if not all(isinstance(value, str) for value in metadata.values()):
            problems.append("trigger metadata values must be strings")
        if trigger.get("type") == "prometheus":
            missing = PROMETHEUS_REQUIRED - set(metadata)
            problems += [f"prometheus trigger needs {k}" for k in sorted(missing)]
            unknown = set(metadata) - PROMETHEUS_REQUIRED - PROMETHEUS_OPTIONAL
            problems += [f"unknown prometheus parameter {k}" for k in sorted(unknown)]
            for name in ("threshold", "activationThreshold"):
                if name in metadata and not _number(str(metadata[name])):
                    problems.append(f"{name} must be a number")
    return problems
