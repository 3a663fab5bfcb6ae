"""Discovery you can trust, the pure part: the registry equals each full list, watch events
(deletes, renames) take effect at once, and a model name's owner is the oldest pool, then
namespace/name, whatever order the objects arrive in. Each pool's endpoints come from its
Service's EndpointSlices; the decoy in every ``status.endpoints`` here is never served."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from slotserve.gateway.pools.config import PoolRegistry
from slotserve.gateway.pools.discovery import PoolCatalog


def ipool(namespace: str, name: str, model: str, created: str):
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {"model": {"name": model}},
        "status": {"endpoints": ["10.9.9.9:8000"]},  # information only: never routed to
    }


def eslice(namespace: str, service: str, address: str) -> dict:
    """The EndpointSlice of a pool's Service, one ready pod, as the controller writes it."""
    return {
        "metadata": {
            "name": f"{service}-x1",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service, "slotserve.dev/pool": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
    }


OLD = ipool("b", "old", "m", "2026-01-01T00:00:00Z")
NEW = ipool("a", "new", "m", "2026-06-01T00:00:00Z")
TWIN = ipool("a", "twin", "m", "2026-01-01T00:00:00Z")  # same age as OLD
SLICES = {
    "a": [eslice("a", "new", "10.0.0.2"), eslice("a", "twin", "10.0.0.3")],
    "b": [eslice("b", "old", "10.0.0.1"), eslice("b", "x", "10.0.0.4")],
}


def served(registry: PoolRegistry) -> dict[str, tuple[str, ...]]:
    return {model: pool.endpoints for model, pool in registry.pools.items()}


@pytest.mark.parametrize("order", list(itertools.permutations([OLD, NEW, TWIN])))
def test_owner_is_the_oldest_then_namespace_name_in_any_order(order):
    # By list and by events, in every arrival order: the same owner (a/twin: as old as b/old,
    # and "a/twin" < "b/old"), the same two conflicts counted.
    for by_events in (False, True):
        registry, counted = PoolRegistry(), list[str]()
        catalog = PoolCatalog(registry, ["a", "b"], counted.append)
        for namespace, slices in SLICES.items():
            catalog.replace_slices(namespace, slices)
        for obj in order:
            source = obj["metadata"]["namespace"]
            if by_events:
                catalog.apply_event(source, "ADDED", obj)
            else:
                same_source = [o for o in order if o["metadata"]["namespace"] == source]
                catalog.replace_list(source, same_source)
        assert served(registry) == {"m": ("http://10.0.0.3:8000",)}
        assert counted == ["m", "m"]  # b/old and a/new, each once


def test_registry_waits_for_every_namespace_and_follows_each_full_list():
    registry = PoolRegistry()
    catalog = PoolCatalog(registry, ["a", "b"])
    catalog.replace_list("a", [NEW])
    catalog.replace_slices("a", SLICES["a"])
    assert registry.synced_version is None  # "b" not listed yet: not ready
    catalog.replace_list("b", [OLD, ipool("b", "x", "x", "2026-01-01T00:00:00Z")])
    assert registry.synced_version is None  # b's EndpointSlices not listed yet: not ready
    assert served(registry) == {"m": (), "x": ()}  # the pools, without endpoints yet
    catalog.replace_slices("b", SLICES["b"])
    assert registry.synced_version is not None
    assert served(registry) == {"m": ("http://10.0.0.1:8000",), "x": ("http://10.0.0.4:8000",)}
    # A re-list without b/old and b/x (deleted while the watch was down): both drop out, and
    # the younger a/new takes over "m".
    catalog.replace_list("b", [])
    assert served(registry) == {"m": ("http://10.0.0.2:8000",)}


def test_watch_events_delete_and_rename_take_effect_at_once():
    registry, counted = PoolRegistry(), list[str]()
    catalog = PoolCatalog(registry, [""], counted.append)
    catalog.replace_slices("", SLICES["a"] + SLICES["b"])
    catalog.replace_list("", [OLD, NEW])
    assert counted == ["m"]
    renamed = ipool("b", "old", "m2", "2026-01-01T00:00:00Z")
    catalog.apply_event("", "MODIFIED", renamed)
    assert served(registry) == {"m": ("http://10.0.0.2:8000",), "m2": ("http://10.0.0.1:8000",)}
    catalog.apply_event("", "DELETED", NEW)
    assert served(registry) == {"m2": ("http://10.0.0.1:8000",)}
    # An object that turns invalid stops serving instead of keeping its last good state.
    broken = ipool("b", "old", "", "2026-01-01T00:00:00Z")
    catalog.apply_event("", "MODIFIED", broken)
    assert served(registry) == {}
    # The conflict ended when b/old was renamed; a new one is counted again.
    catalog.apply_event("", "ADDED", OLD)
    catalog.apply_event("", "ADDED", NEW)
    assert counted == ["m", "m"]


def degraded(obj: dict, reason: str) -> dict:
    condition = {"type": "Degraded", "status": "True", "reason": reason, "message": "x"}
    return {**obj, "status": {**obj["status"], "conditions": [condition]}}


def owner_of(objects: list[dict], **catalog_options) -> dict[str, tuple[str, ...]]:
    registry = PoolRegistry()
    catalog = PoolCatalog(registry, ["a", "b"], **catalog_options)
    for namespace, slices in SLICES.items():
        catalog.replace_slices(namespace, slices)
    for namespace in ("a", "b"):
        catalog.replace_list(
            namespace, [o for o in objects if o["metadata"]["namespace"] == namespace]
        )
    return served(registry)


def test_a_pool_the_operator_refused_owns_no_model_name():
    # b/old is the oldest, but the operator refused it (its image is not allowed): a/twin, the
    # oldest accepted pool, serves the name; trouble that is not a refusal keeps the owner.
    assert owner_of([degraded(OLD, "ImageNotAllowed"), NEW, TWIN]) == {
        "m": ("http://10.0.0.3:8000",)
    }
    assert owner_of([degraded(OLD, "ImageNotAllowed"), degraded(TWIN, "EnvNotAllowed"), NEW]) == {
        "m": ("http://10.0.0.2:8000",)
    }
    assert owner_of([OLD, degraded(TWIN, "Unschedulable"), NEW]) == {"m": ("http://10.0.0.3:8000",)}
    refused_alone = degraded(OLD, "HostPathNotAllowed")
    assert owner_of([refused_alone]) == {}


def test_model_namespaces_keep_a_name_to_the_namespaces_allowed_for_it():
    # A tenant's pool in "a" claimed "m" first (a/twin is as old as b/old and sorts first): with
    # "m" kept to namespace "b", the platform's b/old serves it; other names stay open to all.
    allowed = (("m", frozenset({"b"})), ("other-*", frozenset({"a"})))
    assert owner_of([OLD, NEW, TWIN], model_namespaces=allowed) == {"m": ("http://10.0.0.1:8000",)}
    assert owner_of([NEW, TWIN], model_namespaces=allowed) == {}
    assert owner_of([NEW], model_namespaces=(("x*", frozenset({"b"})),)) == {
        "m": ("http://10.0.0.2:8000",)
    }


def test_model_namespaces_setting_parses_globs_and_lists():
    from slotserve.gateway.settings import GatewaySettings

    # As the environment gives them: text, which the setting parses.
    text: Any = "llama-*=platform, ml ; smollm2=platform"
    settings = GatewaySettings(model_namespaces=text)
    bad: Any = "no-equals-sign"
    assert settings.model_namespaces == {"llama-*": ["platform", "ml"], "smollm2": ["platform"]}
    with pytest.raises(ValueError, match="GLOB=NS1,NS2"):
        GatewaySettings(model_namespaces=bad)
