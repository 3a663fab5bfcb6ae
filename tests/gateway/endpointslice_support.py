"""What Kubernetes' EndpointSlice controller writes; the API emulator has no controller, so tests
write the slices it would.

For a Service with a selector the controller lists the pods it selects, one slice per resolved
port number, labelled ``kubernetes.io/service-name`` plus the Service's own labels (the
operator's include ``slotserve.dev/pool``), each endpoint with its pod (``targetRef``) and
conditions: ``ready`` = pod Ready and not terminating, ``serving`` = pod Ready, ``terminating``
= being deleted. A Service without pods keeps one placeholder slice whose ``endpoints`` is null.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MERGE_PATCH = "application/merge-patch+json"
# The labels of a pool's Service that the gateway selects slices by (operator builders.py).
POOL_SERVICE_LABELS = {"app.kubernetes.io/managed-by": "slotserve-operator"}


@dataclass(frozen=True)
class Pod:
    """An engine pod as a slice lists it: where it listens and what its kubelet reports."""

    url: str  # http://IP:PORT of a real engine (double)
    name: str
    ready: bool = True
    terminating: bool = False

    def endpoint(self, namespace: str) -> dict[str, Any]:
        return {
            "addresses": [urlsplit(self.url).hostname],
            "conditions": {
                "ready": self.ready and not self.terminating,
                "serving": self.ready,
                "terminating": self.terminating,
            },
            "targetRef": {"kind": "Pod", "namespace": namespace, "name": self.name},
        }


def build_slices(
    namespace: str, service: str, pods: list[Pod], labels: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """The controller's slices for ``service`` (with ``labels``) selecting ``pods``, by name."""
    by_port: dict[int | None, list[Pod]] = {}
    for pod in pods:
        by_port.setdefault(urlsplit(pod.url).port, []).append(pod)
    slice_labels = {
        **labels,
        "kubernetes.io/service-name": service,
        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
    }
    slices = {}
    groups = by_port or {None: []}  # no pods: the placeholder slice
    for port, members in groups.items():
        name = f"{service}-{port or 'placeholder'}"
        slices[name] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace, "labels": slice_labels},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}] if port else None,
            "endpoints": [pod.endpoint(namespace) for pod in members] or None,
        }
    return slices


def sync_slices(
    api_client: Any,
    namespace: str,
    service: str,
    pods: list[Pod],
    labels: dict[str, str] | None = None,
) -> None:
    """Make the API's slices of ``service`` what the controller would write for ``pods``:
    create, patch (whole lists: a merge patch replaces arrays) and delete, as it does. Without
    ``labels``, those of a pool's Service (``slotserve.dev/pool`` = the Service's name)."""
    import kubernetes

    if labels is None:
        labels = {**POOL_SERVICE_LABELS, "slotserve.dev/pool": service}
    api = kubernetes.client.DiscoveryV1Api(api_client)
    selector = f"kubernetes.io/service-name={service}"
    listing = api.list_namespaced_endpoint_slice(
        namespace, label_selector=selector, _preload_content=False
    )
    # _preload_content=False: the raw answer (urllib3's), which the client's types do not say.
    items = json.loads(listing.data)["items"]  # type: ignore[attr-defined]
    existing = {item["metadata"]["name"] for item in items}
    wanted = build_slices(namespace, service, pods, labels)
    for name, body in wanted.items():
        if name in existing:
            patch = {key: body[key] for key in ("addressType", "ports", "endpoints")}
            api.patch_namespaced_endpoint_slice(
                name, namespace, patch, _content_type=MERGE_PATCH, _preload_content=False
            )
        else:
            # A dict body: the client sends it as it is, which its types do not say.
            api.create_namespaced_endpoint_slice(namespace, body, _preload_content=False)  # type: ignore[arg-type]
    for name in existing - wanted.keys():
        api.delete_namespaced_endpoint_slice(name, namespace, _preload_content=False)
