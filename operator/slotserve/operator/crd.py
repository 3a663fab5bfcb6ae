"""Generate the InferencePool CustomResourceDefinition from the pydantic models.

``python -m slotserve.operator.crd > crds/inferencepools.slotserve.dev.yaml`` regenerates the
committed file; a test fails when the two drift apart.

Pydantic emits JSON Schema (draft 2020-12); a CRD needs a *structural* OpenAPI v3 schema. The
conversion below inlines ``$ref``s, turns ``Optional[X]`` into an optional ``X`` (CRDs have no
null type), turns numeric ``exclusiveMinimum`` into OpenAPI's boolean form, turns ``const`` into a
one-value ``enum``, drops ``additionalProperties: false`` (not allowed beside ``properties``; the
API server prunes unknown fields instead) and gives every nested object with a default the
default ``{}``, so the API server fills in its fields' defaults.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from slotserve.contracts.crd import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from slotserve.operator import models

HEADER = (
    "# Generated from slotserve/operator/models.py by `python -m slotserve.operator.crd`.\n"
    "# Do not edit by hand: change the models and regenerate (a test fails on drift).\n"
)

# Bounds the shared models (slotserve.contracts.pool_spec) do not declare, but CEL cost
# estimation needs: a rule that iterates a list must know how long the list can be.
_EXTRA_BOUNDS: dict[tuple[str, ...], dict[str, Any]] = {
    ("spec", "batching", "preferredBatchSizes"): {"maxItems": 64},
    ("status", "endpoints"): {"maxItems": 10_000},
    # Map keys are strings in Kubernetes: the levels, as contracts.pool_spec.AdmissionSpec checks.
    ("spec", "admission"): {
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.defaultPriorityLevel) "
                "|| self.defaultPriorityLevel <= self.priorityLevels",
                "message": "defaultPriorityLevel must be at most priorityLevels",
            },
            {
                "rule": "!has(self.priorityQueuePolicy) || self.priorityQueuePolicy.all(level, "
                "level.matches('^[1-9]$') && int(level) <= self.priorityLevels)",
                "message": "every priorityQueuePolicy level must be between 1 and priorityLevels",
            },
        ]
    },
    ("spec", "admission", "priorityQueuePolicy"): {"maxProperties": 9},
    ("status", "admission", "rejectedPerMinute"): {"maxProperties": 32},
    ("status", "admission", "tenants"): {"maxProperties": 16},  # MAX_TENANTS_IN_STATUS
    ("status", "conditions"): {
        "maxItems": 8,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Policy", "type": "string", "jsonPath": ".spec.batching.policy"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Queued", "type": "integer", "jsonPath": ".status.admission.queued"},
    {"name": "In-Flight", "type": "integer", "jsonPath": ".status.admission.inFlight"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


class _CrdJsonSchema(GenerateJsonSchema):
    """Pydantic's generator, but defaults from factories are emitted (models as ``{}``)."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        if "default_factory" in schema and not schema.get("default_factory_takes_data"):
            value = schema["default_factory"]()  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                return {}
            return value if value else NoDefault  # empty lists/maps need no default
        default = schema.get("default", NoDefault)
        return NoDefault if default is None else default


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Convert one pydantic JSON Schema node (recursively) into a structural OpenAPI node."""
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        rules = target.get("x-kubernetes-validations", []) + node.pop(
            "x-kubernetes-validations", []
        )
        node = {**target, **node}
        if rules:
            node["x-kubernetes-validations"] = rules
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        options = [option for option in node.pop("anyOf") if option.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {options} in a CRD schema")
        option = _structural(options[0], defs)
        node = {**option, **{key: value for key, value in node.items() if key != "default"}}
        if "default" in node or "default" in option:
            node["default"] = node.get("default", option.get("default"))
    node.pop("title", None)
    if node.get("default", 0) is None:
        node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[inclusive] = node[bound]
            node[bound] = True
    if "properties" in node:
        node.pop("additionalProperties", None)
        node["type"] = "object"
        node["properties"] = {
            name: _structural(value, defs) for name, value in node["properties"].items()
        }
    elif isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "items" in node:
        node["items"] = _structural(node["items"], defs)
    return node


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model (camelCase names)."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_CrdJsonSchema)
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def _apply_extra_bounds(schema: dict[str, Any]) -> None:
    for path, extra in _EXTRA_BOUNDS.items():
        node = schema
        for name in path:
            node = node["properties"][name]
        node.update(extra)


def openapi_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of the InferencePool kind."""
    schema: dict[str, Any] = {
        "description": (
            "An InferencePool serves one model with a pool of slotserve engine pods "
            "that share a batching policy and gateway admission limits."
        ),
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(models.InferencePoolSpec),
            "status": model_schema(models.InferencePoolStatus),
        },
    }
    _apply_extra_bounds(schema)
    return schema


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object for ``inferencepools.slotserve.dev``."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {
                "app.kubernetes.io/name": "slotserve",
                "app.kubernetes.io/part-of": "slotserve",
            },
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["slotserve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    """The CRD as the YAML text committed under ``crds/``."""
    body = yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)
    return HEADER + body


if __name__ == "__main__":
    sys.stdout.write(render_crd_yaml())
