"""Whether a live child still matches what the operator built (pure; no I/O).

``is_subset`` alone ignores fields the live object has and the built one lacks: right for the
many fields the API server fills in with defaults, wrong for fields someone adds by hand to widen
what the pods may do (``hostNetwork``, a privileged container, a hostPath volume, a Service
selector or NetworkPolicy narrowed to other pods). Those parts are compared exactly; the API
server never defaults them, so a child the operator wrote always compares equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Pod spec fields the server does not default and that grant or change what the pods can do.
STRICT_POD_KEYS = (
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "hostUsers",
    "shareProcessNamespace",
    "initContainers",
    "ephemeralContainers",
    "nodeName",
    "hostAliases",
    "runtimeClassName",
    "serviceAccountName",
    "automountServiceAccountToken",
    "securityContext",
    "volumes",
)
STRICT_CONTAINER_KEYS = ("image", "command", "args", "env", "securityContext", "volumeMounts")
STRICT_SPEC_KEYS = {
    "Service": ("selector", "type"),
    "NetworkPolicy": ("podSelector", "policyTypes", "ingress", "egress"),
}


def is_subset(desired: Any, live: Any) -> bool:
    """Whether every field of ``desired`` is present in ``live`` with the same value.

    Extra fields in ``live`` (server defaults, status) do not count as differences.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(a, b) for a, b in zip(desired, live, strict=True))
        )
    return bool(desired == live)


def _same_keys(desired: Mapping[str, Any], live: Mapping[str, Any], keys: tuple[str, ...]) -> bool:
    return all(desired.get(key) == live.get(key) for key in keys)


def _pod_in_sync(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    if not _same_keys(desired, live, STRICT_POD_KEYS):
        return False
    desired_containers, live_containers = desired["containers"], live.get("containers") or []
    return len(desired_containers) == len(live_containers) and all(
        _same_keys(want, have, STRICT_CONTAINER_KEYS)
        for want, have in zip(desired_containers, live_containers, strict=True)
    )


def in_sync(desired: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether ``live`` is what ``desired`` asks for: no patch needed."""
    if not (
        is_subset(desired["metadata"], live.get("metadata") or {})
        and is_subset(desired["spec"], live.get("spec") or {})
    ):
        return False
    spec, live_spec = desired["spec"], live["spec"]
    if desired["kind"] == "Deployment":
        return _pod_in_sync(spec["template"]["spec"], live_spec["template"].get("spec") or {})
    return _same_keys(spec, live_spec, STRICT_SPEC_KEYS.get(desired["kind"], ()))
