"""The emulator's own tests' custom resource: a Widget CRD (status and scale subresources,
defaults, an enum) and the real kubernetes client on widgets, answering plain dicts."""

from __future__ import annotations

import json
from typing import Any

import kubernetes.client

GROUP, VERSION, PLURAL = "test.kubeapi.dev", "v1", "widgets"
MERGE = "application/merge-patch+json"
WIDGETS = f"{GROUP}/{VERSION}/{PLURAL}"

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                    },
                },
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "required": ["color"],
                                "properties": {
                                    "color": {"type": "string", "enum": ["red", "blue"]},
                                    "replicas": {"type": "integer", "minimum": 0, "default": 1},
                                    "tags": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "phase": {"type": "string"},
                                    "replicas": {"type": "integer"},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, color: str = "red", **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name, **metadata},
        "spec": {"color": color},
    }


def as_json(response: Any) -> Any:
    """The body of a ``_preload_content=False`` call of the kubernetes client."""
    return json.loads(response.data)


class Widgets:
    """The real kubernetes client on the widgets of one namespace, answers as plain dicts."""

    def __init__(self, api: kubernetes.client.CustomObjectsApi, namespace: str = "ns") -> None:
        self.api, self.namespace = api, namespace

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return as_json(
            self.api.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body, _preload_content=False
            )
        )

    def get(self, name: str) -> dict[str, Any]:
        return as_json(
            self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, _preload_content=False
            )
        )

    def list(self, selector: str = "") -> dict[str, Any]:
        return as_json(
            self.api.list_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                label_selector=selector,
                _preload_content=False,
            )
        )

    def patch(self, name: str, patch: Any, subresource: str = "") -> dict[str, Any]:
        method = {
            "": self.api.patch_namespaced_custom_object,
            "status": self.api.patch_namespaced_custom_object_status,
            "scale": self.api.patch_namespaced_custom_object_scale,
        }[subresource]
        content_type = "application/json-patch+json" if isinstance(patch, list) else MERGE
        return as_json(
            method(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                name,
                patch,
                _content_type=content_type,
                _preload_content=False,
            )
        )

    def delete(self, name: str) -> dict[str, Any]:
        return as_json(
            self.api.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, _preload_content=False
            )
        )
