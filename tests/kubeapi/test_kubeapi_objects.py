"""The emulator's object API through the real kubernetes client: create, get, list, patch,
delete; resourceVersion and generation; conflicts; subresources; finalizers; selectors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client import ApiException, CoreV1Api

from .thread import ApiServerThread
from .widget_crd import GROUP, PLURAL, Widgets, widget


def refused(call: Any, *args: Any) -> tuple[int, dict[str, Any]]:
    """Make a call that must fail: its HTTP status and the Status object it answered."""
    with pytest.raises(ApiException) as error:
        call(*args)
    assert error.value.body is not None
    return error.value.status, json.loads(error.value.body)


def test_create_get_list_delete_round_trip(widgets: Widgets):
    created = widgets.create(widget("w1"))
    meta = created["metadata"]
    assert meta["namespace"] == "ns" and meta["generation"] == 1
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0
    assert widgets.get("w1") == created

    listing = widgets.list()
    assert listing["kind"] == "WidgetList" and listing["apiVersion"] == f"{GROUP}/v1"
    assert [item["metadata"]["name"] for item in listing["items"]] == ["w1"]
    assert int(listing["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])

    widgets.delete("w1")
    status, body = refused(widgets.get, "w1")
    assert status == 404 and body["kind"] == "Status"
    assert widgets.list()["items"] == []


def test_a_name_is_taken_until_deleted_and_generate_name_makes_one(widgets: Widgets):
    first = widgets.create(widget("w1"))
    status, body = refused(widgets.create, widget("w1"))
    assert (status, body["reason"]) == (409, "AlreadyExists")
    widgets.delete("w1")
    again = widgets.create(widget("w1"))
    assert again["metadata"]["uid"] != first["metadata"]["uid"]

    generated = widgets.create({**widget(""), "metadata": {"generateName": "w-"}})
    assert generated["metadata"]["name"].startswith("w-") and len(generated["metadata"]["name"]) > 2


def test_resource_version_and_generation_follow_the_writes(widgets: Widgets):
    rv = lambda obj: int(obj["metadata"]["resourceVersion"])  # noqa: E731
    created = widgets.create(widget("w1"))

    labelled = widgets.patch("w1", {"metadata": {"labels": {"tier": "a"}}})
    assert rv(labelled) > rv(created) and labelled["metadata"]["generation"] == 1

    respecced = widgets.patch("w1", {"spec": {"color": "blue"}})
    assert rv(respecced) > rv(labelled) and respecced["metadata"]["generation"] == 2

    same = widgets.patch("w1", {"spec": {"color": "blue"}})
    assert same == respecced  # a no-op write changes nothing, not even the resourceVersion

    other = widgets.create(widget("w2"))
    assert rv(other) > rv(respecced)  # one counter for the whole server


def test_a_patch_naming_a_stale_resource_version_is_a_conflict(widgets: Widgets):
    created = widgets.create(widget("w1"))
    stale = created["metadata"]["resourceVersion"]
    widgets.patch("w1", {"spec": {"color": "blue"}})

    patch = {"metadata": {"resourceVersion": stale}, "spec": {"color": "red"}}
    status, body = refused(widgets.patch, "w1", patch)
    assert (status, body["reason"]) == (409, "Conflict")
    assert widgets.get("w1")["spec"]["color"] == "blue"

    current = widgets.get("w1")["metadata"]["resourceVersion"]
    patch["metadata"]["resourceVersion"] = current
    assert widgets.patch("w1", patch)["spec"]["color"] == "red"


def test_merge_patches_and_json_patches(widgets: Widgets):
    widgets.create({**widget("w1"), "spec": {"color": "red", "tags": ["a", "b"]}})
    merged = widgets.patch("w1", {"spec": {"tags": ["c"]}})
    assert merged["spec"] == {"color": "red", "tags": ["c"], "replicas": 1}  # lists replace

    json_patched = widgets.patch("w1", [{"op": "add", "path": "/spec/tags/-", "value": "d"}])
    assert json_patched["spec"]["tags"] == ["c", "d"]

    removed = widgets.patch("w1", {"spec": {"tags": None, "replicas": None}})
    assert removed["spec"] == {"color": "red", "replicas": 1}  # null removes; defaults return


def test_status_is_written_only_through_the_status_subresource(widgets: Widgets):
    created = widgets.create({**widget("w1"), "status": {"phase": "Made up"}})
    assert "status" not in created  # the status of a create is ignored

    main = widgets.patch("w1", {"spec": {"color": "blue"}, "status": {"phase": "Ignored"}})
    assert main["spec"]["color"] == "blue" and "status" not in main

    status = widgets.patch("w1", {"spec": {"color": "red"}, "status": {"phase": "Ready"}}, "status")
    assert status["status"] == {"phase": "Ready"} and status["spec"]["color"] == "blue"
    assert status["metadata"]["generation"] == main["metadata"]["generation"]


def test_the_scale_subresource_sets_spec_replicas(widgets: Widgets):
    widgets.create(widget("w1"))
    widgets.patch("w1", {"spec": {"replicas": 5}}, "scale")
    scaled = widgets.get("w1")
    assert scaled["spec"]["replicas"] == 5 and scaled["metadata"]["generation"] == 2


def test_finalizers_hold_a_deletion_until_the_last_one_is_removed(widgets: Widgets):
    widgets.create(widget("w1", finalizers=["test.kubeapi.dev/hold"]))
    widgets.delete("w1")
    held = widgets.get("w1")
    assert held["metadata"]["deletionTimestamp"]
    assert (
        widgets.delete("w1")["metadata"]["resourceVersion"] == held["metadata"]["resourceVersion"]
    )  # deleting again changes nothing

    widgets.patch("w1", {"metadata": {"finalizers": None}})
    assert refused(widgets.get, "w1")[0] == 404


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("", ["a", "b", "c"]),
        ("tier=web", ["a"]),
        ("tier==web", ["a"]),
        ("tier!=web", ["b", "c"]),
        ("tier", ["a", "b"]),
        ("!tier", ["c"]),
        ("tier=db,zone=x", ["b"]),
    ],
)
def test_label_selectors_filter_lists(widgets: Widgets, selector: str, names: list[str]):
    widgets.create(widget("a", labels={"tier": "web"}))
    widgets.create(widget("b", labels={"tier": "db", "zone": "x"}))
    widgets.create(widget("c"))
    assert [item["metadata"]["name"] for item in widgets.list(selector)["items"]] == names


def test_namespaces_separate_objects(widgets: Widgets):
    widgets.create(widget("w1"))
    elsewhere = Widgets(widgets.api, namespace="other")
    assert elsewhere.list()["items"] == []
    assert refused(elsewhere.get, "w1")[0] == 404
    cluster_wide = widgets.api.list_cluster_custom_object(
        GROUP, "v1", PLURAL, _preload_content=False
    )
    # _preload_content=False: the raw answer (urllib3's), which the client's types do not say.
    items = json.loads(cluster_wide.data)["items"]  # type: ignore[attr-defined]
    assert [i["metadata"]["namespace"] for i in items] == ["ns"]


def test_unknown_resources_and_objects_are_404(widgets: Widgets, core: CoreV1Api):
    status, _ = refused(
        widgets.api.list_namespaced_custom_object, "nowhere.dev", "v1", "ns", "gadgets"
    )
    assert status == 404
    assert refused(core.read_namespaced_config_map, "missing", "ns")[0] == 404
    assert refused(widgets.patch, "missing", {"spec": {}})[0] == 404
    assert refused(widgets.delete, "missing")[0] == 404


def test_calls_and_writes_are_recorded_for_assertions(apiserver: ApiServerThread, widgets: Widgets):
    widgets.api.api_client.user_agent = "test-agent/1"
    widgets.create(widget("w1"))
    widgets.patch("w1", {"status": {"phase": "Ready"}}, "status")
    widgets.list("tier=web")
    widgets.delete("w1")
    server = apiserver.server
    assert server is not None
    mine = [call for call in server.calls if call.user_agent == "test-agent/1"]
    assert [(c.verb, c.group, c.resource, c.label_selector) for c in mine] == [
        ("create", GROUP, "widgets", ""),
        ("patch", GROUP, "widgets/status", ""),
        ("list", GROUP, "widgets", "tier=web"),
        ("delete", GROUP, "widgets", ""),
    ]
    assert [tuple(write) for write in server.writes] == [
        ("CREATE", "widgets", "ns", "w1"),
        ("UPDATE", "widgets/status", "ns", "w1"),
        ("DELETE", "widgets", "ns", "w1"),
    ]
    history = server.objects[f"{GROUP}/v1/{PLURAL}", "ns", "w1"].history
    assert [None if v is None else v.get("status") for v in history] == [
        None,
        {"phase": "Ready"},
        None,
    ]
