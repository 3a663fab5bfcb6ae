"""A check of ``inference.networking.k8s.io/v1`` InferencePools, written from the Gateway API
inference extension's v1 API reference (its Go types' documented fields and kubebuilder
markers), not copied from it:

- ``spec.selector``: required; only ``matchLabels`` (required, at most 64 entries), keys
  qualified label names, values label values (the simplified LabelSelector);
- ``spec.targetPorts``: required, at least 1 item (v1.0's types allow 1, later references 8),
  each only ``number`` in 1..65535, numbers unique;
- ``spec.endpointPickerRef``: required by v1; ``name`` required (1..253), ``group`` "" or a DNS
  subdomain, ``kind`` a Kind (default Service), ``portNumber`` 1..65535 (9002 is the default
  implementations infer for a Service), ``failureMode`` FailOpen or FailClose;
- ``spec.appProtocol``: optional, ``http`` or ``kubernetes.io/h2c``.
"""

from __future__ import annotations

import re
from typing import Any

SPEC_FIELDS = {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
REF_FIELDS = {"group", "kind", "name", "portNumber", "failureMode"}
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
MAX_TARGET_PORTS = 8


def _port(value: Any) -> bool:
    return isinstance(value, int) and 1 <= value <= 65535


def inference_pool_problems(obj: dict[str, Any]) -> list[str]:
    """Everything in ``obj`` that the v1 InferencePool API does not allow."""
    problems = []
    if obj.get("apiVersion") != "inference.networking.k8s.io/v1":
        problems.append("apiVersion must be inference.networking.k8s.io/v1")
    if obj.get("kind") != "InferencePool":
        problems.append("kind must be InferencePool")
    spec = obj.get("spec") or {}
    problems += [f"unknown spec field {k}" for k in set(spec) - SPEC_FIELDS]
    selector = spec.get("selector")
    if not isinstance(selector, dict) or set(selector) != {"matchLabels"}:
        problems.append("selector must hold matchLabels only")
    else:
        labels = selector["matchLabels"]
        if not labels or len(labels) > 64:
            problems.append("matchLabels needs 1..64 entries")
        for key, value in labels.items():
            if len(key) > 253 or not LABEL_KEY.match(key):
                problems.append(f"label key {key!r} is not a qualified name")
            if len(value) > 63 or not LABEL_VALUE.match(value):
                problems.append(f"label value {value!r} is not a label value")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= MAX_TARGET_PORTS:
        problems.append(f"targetPorts needs 1..{MAX_TARGET_PORTS} items")
    else:
        for port in ports:
            if set(port) != {"number"} or not _port(port["number"]):
                problems.append(f"target port {port} must be {{number: 1..65535}}")
        numbers = [port.get("number") for port in ports]
        if len(set(numbers)) != len(numbers):
            problems.append("target port numbers must be unique")
    ref = spec.get("endpointPickerRef")
    if not isinstance(ref, dict):
        return [*problems, "endpointPickerRef is required"]
    problems += [f"unknown endpointPickerRef field {k}" for k in set(ref) - REF_FIELDS]
    if not isinstance(ref.get("name"), str) or not 1 <= len(ref["name"]) <= 253:
        problems.append("endpointPickerRef.name is required (1..253 characters)")
    if not GROUP.match(str(ref.get("group", ""))):
        problems.append("endpointPickerRef.group must be empty or a DNS subdomain")
    if not KIND.match(str(ref.get("kind", "Service"))):
        problems.append("endpointPickerRef.kind is not a Kind")
    if "portNumber" in ref and not _port(ref["portNumber"]):
        problems.append("endpointPickerRef.portNumber must be 1..65535")
    if ref.get("failureMode", "FailClose") not in {"FailOpen", "FailClose"}:
        problems.append("endpointPickerRef.failureMode must be FailOpen or FailClose")
    if spec.get("appProtocol", "http") not in {"http", "kubernetes.io/h2c"}:
        problems.append("appProtocol must be http or kubernetes.io/h2c")
    return problems
