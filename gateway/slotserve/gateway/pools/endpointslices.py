"""Engine endpoints from the cluster: the EndpointSlices of each pool's Service.

The operator gives every InferencePool a Service of the same name and namespace whose selector
picks the pool's engine pods (operator builders.py). Kubernetes' EndpointSlice controller
lists those pods in EndpointSlices labelled ``kubernetes.io/service-name=<service>``, with each
pod's readiness as the kubelet reports it. Routing from these, not from the pool's writable
``status.endpoints``, means only pods that the Service selects and that are ready get traffic.

Pure: ``endpoints_of_slice`` reads one slice; ``EndpointIndex`` holds what full lists and watch
events said and answers a Service's ready endpoints. No I/O here (``discovery.py`` does it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from slotserve.contracts.crd import ENGINE_PORT_NAME, POOL_LABEL

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The controller copies a Service's labels onto its slices; every pool's Service carries the
# pool label, so this keeps a cluster-wide gateway from listing every slice in the cluster.
SLICE_SELECTOR = f"{SERVICE_NAME_LABEL},{POOL_LABEL}"
# When a dual-stack Service lists one pod in an IPv4 and an IPv6 slice, the pod is one engine
# (one set of slots): it is routed to once, IPv4 first.
FAMILY_ORDER = {"IPv4": 0, "IPv6": 1}


@dataclass(frozen=True)
class SliceEndpoint:
    """One ready endpoint of a slice: the pod it stands for, its address family and URL."""

    pod: str  # targetRef "namespace/name", else the address itself
    family: int
    url: str


@dataclass(frozen=True)
class ParsedSlice:
    service: str  # "namespace/service-name"
    endpoints: tuple[SliceEndpoint, ...]


def slice_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def service_of(obj: dict[str, Any]) -> str:
    """The Service a slice belongs to, "namespace/name"; "" when it names none."""
    meta = obj.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return f"{meta.get('namespace', '')}/{service}" if isinstance(service, str) and service else ""


def engine_port(obj: dict[str, Any]) -> int | None:
    """The TCP port named ``ENGINE_PORT_NAME`` in a slice; None when the slice has none."""
    for port in obj.get("ports") or []:
        if not isinstance(port, dict) or port.get("name") != ENGINE_PORT_NAME:
            continue
        number = port.get("port")
        if port.get("protocol", "TCP") == "TCP" and isinstance(number, int) and number > 0:
            return number
    return None


def is_ready(endpoint: dict[str, Any]) -> bool:
    """Ready and not terminating. The API reads a missing ``ready`` as ready; here it must be
    stated: the EndpointSlice controller always states it, so nothing real is lost."""
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is True and conditions.get("terminating") is not True


def endpoints_of_slice(obj: dict[str, Any]) -> tuple[SliceEndpoint, ...]:
    """The ready endpoints of one EndpointSlice object, as the API returns it."""
    family = obj.get("addressType")
    port = engine_port(obj)
    if family not in FAMILY_ORDER or port is None:  # FQDN slices, or no engine port
        return ()
    found = []
    for endpoint in obj.get("endpoints") or []:  # null in a placeholder slice (no pods)
        if not isinstance(endpoint, dict) or not is_ready(endpoint):
            continue
        addresses = endpoint.get("addresses") or []
        if not addresses or not isinstance(addresses[0], str) or not addresses[0]:
            continue
        address = addresses[0]  # the controller writes one; consumers use the first
        host = f"[{address}]" if family == "IPv6" else address
        ref = endpoint.get("targetRef") or {}
        pod = f"{ref.get('namespace', '')}/{ref['name']}" if ref.get("name") else address
        found.append(SliceEndpoint(pod, FAMILY_ORDER[family], f"http://{host}:{port}"))
    return tuple(found)


def parse_slice(obj: dict[str, Any]) -> ParsedSlice | None:
    service = service_of(obj)
    if not service:
        return None
    return ParsedSlice(service, endpoints_of_slice(obj))


class EndpointIndex:
    """Every EndpointSlice seen, per watched namespace, and the ready endpoints of each Service.

    Like the pool catalog: a full list replaces what its namespace held (a slice deleted while a
    watch was down goes at the next list); a watch event replaces or removes one slice.
    """

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, ParsedSlice]] = {}  # source -> slice key -> slice
        self.by_service: dict[str, dict[str, ParsedSlice]] = {}  # service -> slice key -> slice

    def replace_list(self, source: str, objects: Iterable[dict[str, Any]]) -> None:
        for key, old in self.slices.pop(source, {}).items():
            self._unindex(key, old)
        held: dict[str, ParsedSlice] = {}
        for obj in objects:
            parsed = parse_slice(obj)
            if parsed is not None:
                held[slice_key(obj)] = parsed
                self.by_service.setdefault(parsed.service, {})[slice_key(obj)] = parsed
        self.slices[source] = held

    def apply_event(self, source: str, event_type: str, obj: dict[str, Any]) -> None:
        held = self.slices.setdefault(source, {})
        key = slice_key(obj)
        old = held.pop(key, None)
        if old is not None:
            self._unindex(key, old)
        parsed = parse_slice(obj) if event_type in ("ADDED", "MODIFIED") else None
        if parsed is not None:
            held[key] = parsed
            self.by_service.setdefault(parsed.service, {})[key] = parsed

    def _unindex(self, key: str, parsed: ParsedSlice) -> None:
        slices = self.by_service.get(parsed.service, {})
        slices.pop(key, None)
        if not slices:
            self.by_service.pop(parsed.service, None)

    def endpoints_for(self, service: str) -> tuple[str, ...]:
        """The URLs of the Service's ready endpoints (one per pod), sorted."""
        best: dict[str, SliceEndpoint] = {}
        for parsed in self.by_service.get(service, {}).values():
            for endpoint in parsed.endpoints:
                current = best.get(endpoint.pod)
                if current is None or (endpoint.family, endpoint.url) < (
                    current.family,
                    current.url,
                ):
                    best[endpoint.pod] = endpoint
        return tuple(sorted({endpoint.url for endpoint in best.values()}))
