"""What the API server checks before it stores a write: schemas and admission policies.

Custom resources are defaulted, pruned and validated against their CRD's openAPIV3Schema
(JSON Schema draft 4, as the API server's structural schemas are); CEL rules
(``x-kubernetes-validations``) are not evaluated. Built-in kinds named in ``BUILTIN_VALIDATED``
are validated strictly (types and unknown fields, not the server's semantic checks) against
Kubernetes ``K8S_VERSION``'s schemas with kubernetes-validate. Policies stand in for validating
admission webhooks (Kyverno, Gatekeeper). Every refusal is a 422 Invalid, like the real server's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import kmock
import kubernetes_validate

K8S_VERSION = "1.37.0"
BUILTIN_VALIDATED = frozenset({"deployments", "services", "pods", "networkpolicies"})

# (plural, object) -> a denial message, or "" to allow. It may also raise kmock.KubernetesError
# to answer with another status (a 503 makes a flaky write path).
Policy = Callable[[str, dict[str, Any]], str]


def apply_defaults(schema: dict[str, Any], value: Any) -> None:
    """Fill in schema defaults in place, top-down, like the API server's defaulting."""
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
        for name, item in value.items():
            child = schema.get("properties", {}).get(name)
            if child is None and isinstance(schema.get("additionalProperties"), dict):
                child = schema["additionalProperties"]
            if child is not None:
                apply_defaults(child, item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(schema["items"], item)


def prune(schema: dict[str, Any], value: Any) -> None:
    """Drop fields the schema does not declare, in place (structural-schema pruning)."""
    if isinstance(value, dict) and "properties" in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            for name in [name for name in value if name not in schema["properties"]]:
                del value[name]
        for name, item in value.items():
            child = schema["properties"].get(name)
            if name != "metadata" and child is not None:
                prune(child, item)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for item in value.values():
            prune(schema["additionalProperties"], item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            prune(schema["items"], item)


def invalid(message: str, details: dict[str, Any] | None = None) -> kmock.KubernetesError:
    """The API server's 422 Invalid answer."""
    return kmock.KubernetesError(status=422, reason="Invalid", message=message, details=details)


@dataclass
class Admission:
    """The checks of every create and patch; ``admit`` may complete the object (defaults)."""

    # openAPIV3Schema of custom resources, by resource; objects of these are validated.
    schemas: dict[kmock.resource, dict[str, Any]] = field(default_factory=dict)
    # Validating admission, in order; the first denial refuses the write.
    policies: list[Policy] = field(default_factory=list)

    def admit(self, resource: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        """Default, prune and validate ``obj`` in place; raise a 422 if it may not be stored."""
        for policy in self.policies:
            if denial := policy(str(resource.plural), obj):
                raise invalid(f'admission webhook "policy.test" denied the request: {denial}')
        schema = self.schemas.get(resource)
        if schema is not None:
            self._validate_custom(schema, kind, resource, obj)
        elif resource.plural in BUILTIN_VALIDATED:
            self._validate_builtin(resource, kind, obj)

    @staticmethod
    def _validate_custom(
        schema: dict[str, Any], kind: str, resource: kmock.resource, obj: dict[str, Any]
    ) -> None:
        apply_defaults(schema, obj)
        prune(schema, obj)
        errors = sorted(
            jsonschema.Draft4Validator(schema).iter_errors(obj), key=lambda e: list(e.path)
        )
        if errors:
            name = obj["metadata"].get("name")
            causes = "; ".join(
                f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
            )
            raise invalid(
                f'{kind}.{resource.group} "{name}" is invalid: {causes}',
                {"kind": kind, "name": name},
            )

    @staticmethod
    def _validate_builtin(resource: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        api_version = f"{resource.group}/{resource.version}" if resource.group else "v1"
        try:
            kubernetes_validate.validate(
                {"apiVersion": api_version, "kind": kind, **obj}, K8S_VERSION, strict=True
            )
        except kubernetes_validate.ValidationError as error:
            name = obj["metadata"].get("name")
            raise invalid(f'{kind} "{name}" is invalid: {error.message}') from error
