"""What the emulator refuses or completes before it stores a write: CRD schemas (defaults,
pruning, 422), built-in kinds (strict schemas), and test admission policies."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import kmock
import pytest
from kubernetes.client import ApiException, CoreV1Api

from .thread import ApiServerThread
from .widget_crd import Widgets, widget


def refusal(call: Any, *args: Any) -> tuple[int, str]:
    with pytest.raises(ApiException) as error:
        call(*args, _preload_content=False)
    assert error.value.body is not None
    return error.value.status, json.loads(error.value.body)["message"]


def deployment(name: str, **pod_spec: Any) -> dict[str, Any]:
    labels = {"app": name}
    container = {"name": "main", "image": "registry.test/app:1", **pod_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }


def test_custom_resources_get_their_schema_defaults_and_lose_undeclared_fields(
    widgets: Widgets,
):
    body = widget("w1")
    body["spec"]["unknown"] = "dropped"
    body["extra"] = {"also": "dropped"}
    created = widgets.create(body)
    assert created["spec"] == {"color": "red", "replicas": 1}
    assert "extra" not in created


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ({"color": "green"}, "spec.color"),
        ({"color": "red", "replicas": -1}, "spec.replicas"),
        ({"color": "red", "replicas": "two"}, "spec.replicas"),
        ({}, "'color' is a required property"),
    ],
)
def test_a_custom_resource_against_its_schema_is_422_and_not_stored(
    widgets: Widgets, spec: dict[str, Any], complaint: str
):
    body = {**widget("w1"), "spec": spec}
    status, message = refusal(
        widgets.api.create_namespaced_custom_object, *coordinates(widgets), body
    )
    assert status == 422 and complaint in message and 'Widget.test.kubeapi.dev "w1"' in message
    assert widgets.list()["items"] == []


def coordinates(widgets: Widgets) -> tuple[str, str, str, str]:
    return ("test.kubeapi.dev", "v1", widgets.namespace, "widgets")


def test_a_patch_that_breaks_the_schema_is_422_and_leaves_the_object(widgets: Widgets):
    created = widgets.create(widget("w1"))
    with pytest.raises(ApiException) as error:
        widgets.patch("w1", {"spec": {"color": "green"}})
    assert error.value.status == 422
    assert widgets.get("w1") == created


def send(url: str, method: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Plain HTTP: the kubernetes client itself refuses to send unknown fields."""
    content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": content_type}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_built_in_kinds_are_validated_strictly(apiserver: ApiServerThread):
    deployments = f"{apiserver.url}/apis/apps/v1/namespaces/ns/deployments"
    assert send(deployments, "POST", deployment("good"))[0] == 200
    status, body = send(deployments, "POST", deployment("bad", imagePullPolicyy="Always"))
    assert status == 422 and 'Deployment "bad" is invalid' in body["message"]
    status, _ = send(f"{deployments}/good", "PATCH", {"spec": {"replicas": "many"}})
    assert status == 422
    assert send(f"{deployments}/good", "PATCH", {"spec": {"replicas": 3}})[0] == 200


def test_policies_refuse_writes_like_a_validating_webhook(
    apiserver: ApiServerThread, core: CoreV1Api
):
    assert apiserver.server is not None

    def no_secrets_in_config_maps(plural: str, obj: dict[str, Any]) -> str:
        leaks = plural == "configmaps" and "password" in obj.get("data", {})
        return "no passwords in ConfigMaps" if leaks else ""

    apiserver.server.policies.append(no_secrets_in_config_maps)
    config_map = {"metadata": {"name": "c"}, "data": {"password": "hunter2"}}
    status, message = refusal(core.create_namespaced_config_map, "ns", config_map)
    assert status == 422 and "no passwords in ConfigMaps" in message
    # A dict body: the client sends it as it is (its types say a V1ConfigMap).
    core.create_namespaced_config_map(
        "ns",
        {"metadata": {"name": "c"}, "data": {"user": "me"}},  # type: ignore[arg-type]
        _preload_content=False,
    )


def test_a_policy_can_fail_a_write_with_any_status(apiserver: ApiServerThread, core: CoreV1Api):
    assert apiserver.server is not None

    def down(plural: str, obj: dict[str, Any]) -> str:
        raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="down")

    apiserver.server.policies.append(down)
    status, message = refusal(core.create_namespaced_config_map, "ns", {"metadata": {"name": "c"}})
    assert (status, message) == (503, "down")
    apiserver.server.policies.remove(down)
    assert refusal(core.read_namespaced_config_map, "c", "ns")[0] == 404  # nothing was stored
