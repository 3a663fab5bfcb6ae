"""The emulator's garbage collector: deleting an owner deletes its dependents (background
propagation, recursively), but not those with another owner still alive."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import ApiException, CoreV1Api

from .widget_crd import Widgets, widget


def owned_by(*owners: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": owner.get("apiVersion", "v1"),
            "kind": owner.get("kind", "ConfigMap"),
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
        }
        for owner in owners
    ]


def config_map(core: CoreV1Api, name: str, *owners: dict[str, Any], **meta: Any) -> dict:
    body = {"metadata": {"name": name, "ownerReferences": owned_by(*owners), **meta}}
    # A dict body: the client sends it as it is (its types say a V1ConfigMap).
    core.create_namespaced_config_map("ns", body)  # type: ignore[arg-type]
    return core.api_client.sanitize_for_serialization(core.read_namespaced_config_map(name, "ns"))


def exists(core: CoreV1Api, name: str) -> bool:
    try:
        core.read_namespaced_config_map(name, "ns")
    except ApiException as error:
        assert error.status == 404
        return False
    return True


def test_deleting_an_owner_deletes_its_dependents_recursively(widgets: Widgets, core: CoreV1Api):
    owner = widgets.create(widget("w1"))
    child = config_map(core, "child", owner)
    config_map(core, "grandchild", child)
    config_map(core, "bystander")
    other = widgets.create(widget("w2"))
    config_map(core, "other-child", other)

    widgets.delete("w1")
    assert not exists(core, "child") and not exists(core, "grandchild")
    assert exists(core, "bystander") and exists(core, "other-child")


def test_a_dependent_stays_while_another_owner_lives(widgets: Widgets, core: CoreV1Api):
    first, second = widgets.create(widget("w1")), widgets.create(widget("w2"))
    config_map(core, "shared", first, second)
    widgets.delete("w1")
    assert exists(core, "shared")
    widgets.delete("w2")
    assert not exists(core, "shared")


def test_a_dependent_with_a_finalizer_is_marked_not_removed(widgets: Widgets, core: CoreV1Api):
    owner = widgets.create(widget("w1"))
    config_map(core, "held", owner, finalizers=["test.kubeapi.dev/hold"])
    widgets.delete("w1")
    held = core.read_namespaced_config_map("held", "ns")
    assert held.metadata is not None and held.metadata.deletion_timestamp is not None


@pytest.mark.parametrize("finalizers", [[], ["test.kubeapi.dev/hold"]])
def test_dependents_go_only_once_the_owner_is_gone(
    widgets: Widgets, core: CoreV1Api, finalizers: list[str]
):
    owner = widgets.create(widget("w1", finalizers=finalizers))
    config_map(core, "child", owner)
    widgets.delete("w1")
    assert exists(core, "child") == bool(finalizers)  # marked for deletion is not gone
    if finalizers:
        widgets.patch("w1", {"metadata": {"finalizers": None}})
        assert not exists(core, "child")
