"""Endpoints from the cluster, the pure part: which endpoints of a pool's Service's
EndpointSlices get traffic (ready and not terminating, on the engine port, one per pod), and
how lists and watch events change the registry at once."""

from __future__ import annotations

import copy

from slotserve.gateway.pools import endpointslices
from slotserve.gateway.pools.config import PoolRegistry
from slotserve.gateway.pools.discovery import PoolCatalog
from slotserve.gateway.pools.endpointslices import EndpointIndex, endpoints_of_slice
from slotserve.operator import builders


def endpoint(address: str, pod: str = "", **conditions: bool) -> dict:
    ready = {"ready": True, "serving": True, "terminating": False}
    found = {"addresses": [address], "conditions": {**ready, **conditions}}
    if pod:
        found["targetRef"] = {"kind": "Pod", "namespace": "ml", "name": pod}
    return found


def eslice(*endpoints: dict, name: str = "small-a", service: str = "small", **fields) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {"kubernetes.io/service-name": service, "slotserve.dev/pool": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": list(endpoints),
        **fields,
    }


def urls(obj: dict) -> list[str]:
    return [found.url for found in endpoints_of_slice(obj)]


def test_the_engine_port_name_is_the_operators():
    assert endpointslices.ENGINE_PORT_NAME == builders.ENGINE_PORT_NAME
    assert endpointslices.POOL_LABEL == builders.POOL_LABEL


def test_only_ready_endpoints_that_are_not_terminating():
    obj = eslice(
        endpoint("10.0.0.1"),
        endpoint("10.0.0.2", ready=False, serving=False),  # readiness probe failing
        endpoint("10.0.0.3", ready=False, serving=True, terminating=True),  # draining
        endpoint("10.0.0.4", terminating=True),  # ready but terminating: no new work
        {"addresses": ["10.0.0.5"], "conditions": {}},  # readiness unknown: not routed
        {"addresses": [], "conditions": {"ready": True}},
    )
    assert urls(obj) == ["http://10.0.0.1:8000"]


def test_the_port_is_the_one_named_like_the_services_engine_port():
    other_first = [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8123}]
    assert urls(eslice(endpoint("10.0.0.1"), ports=other_first)) == ["http://10.0.0.1:8123"]
    for ports in ([{"name": "metrics", "port": 9090}], [], None, [{"name": "http"}]):
        assert urls(eslice(endpoint("10.0.0.1"), ports=ports)) == []
    udp = [{"name": "http", "port": 8000, "protocol": "UDP"}]
    assert urls(eslice(endpoint("10.0.0.1"), ports=udp)) == []


def test_address_types_and_a_placeholder_slice():
    assert urls(eslice(endpoint("fd00::7"), addressType="IPv6")) == ["http://[fd00::7]:8000"]
    assert urls(eslice(endpoint("engine.example"), addressType="FQDN")) == []
    assert urls(eslice(endpoints=None)) == []  # a Service without pods: endpoints is null


def test_index_one_engine_per_pod_lists_and_events():
    index = EndpointIndex()
    v4 = eslice(endpoint("10.0.0.1", pod="small-1"), endpoint("10.0.0.2", pod="small-2"))
    # Dual stack: the same pods again in an IPv6 slice; each pod is one engine (its slots).
    v6 = eslice(endpoint("fd00::1", pod="small-1"), name="small-b", addressType="IPv6")
    other = eslice(endpoint("10.0.1.1"), name="big-a", service="big")
    index.replace_list("ml", [v6, v4, other])
    assert index.endpoints_for("ml/small") == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert index.endpoints_for("ml/big") == ("http://10.0.1.1:8000",)
    assert index.endpoints_for("other/small") == ()  # a Service is per namespace
    index.apply_event("ml", "DELETED", v4)
    assert index.endpoints_for("ml/small") == ("http://[fd00::1]:8000",)
    index.replace_list("ml", [other])  # a re-list drops what the watch missed
    assert index.endpoints_for("ml/small") == ()
    assert index.by_service.keys() == {"ml/big"}


def test_catalog_follows_slice_events_and_never_serves_status_endpoints():
    registry = PoolRegistry()
    catalog = PoolCatalog(registry, ["ml"])
    pool = {
        "metadata": {
            "name": "small",
            "namespace": "ml",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"model": {"name": "m"}},
        "status": {"endpoints": ["203.0.113.9:8000"]},  # written by whoever may patch status
    }
    catalog.replace_list("ml", [pool])
    assert registry.synced_version is None  # the slices are not listed yet
    live = eslice(endpoint("10.0.0.1", pod="small-1"))
    catalog.replace_slices("ml", [live])
    assert registry.synced_version is not None
    assert registry.get("m").endpoints == ("http://10.0.0.1:8000",)
    # Each slice change is one watch event and takes effect with it.
    changed = copy.deepcopy(live)
    changed["endpoints"][0]["conditions"].update(ready=False, terminating=True)
    changed["endpoints"].append(endpoint("10.0.0.2", pod="small-2"))
    catalog.apply_slice_event("ml", "MODIFIED", changed)
    assert registry.get("m").endpoints == ("http://10.0.0.2:8000",)
    catalog.apply_slice_event("ml", "DELETED", changed)
    assert registry.get("m").endpoints == ()
    assert "http://203.0.113.9:8000" not in registry.endpoints()
