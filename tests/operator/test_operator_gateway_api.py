"""spec.gatewayAPI.inferencePool: an owned inference.networking.k8s.io/v1 InferencePool over the
pool's engine pods, checked against the v1 API's documented fields and rules
(``gateway_api_inferencepool``); on the emulator with real kopf: created, owned, patched, and
refused (Degraded + Warning) when the Gateway API CRD is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import kubernetes.client
import pytest
import yaml

from slotserve.operator.builders import build_deployment
from slotserve.operator.gateway_api import (
    GATEWAY_GROUP,
    GATEWAY_PLURAL,
    GATEWAY_VERSION,
    build_gateway_inference_pool,
)
from slotserve.operator.models import InferencePool
from tests.operator.gateway_api_inferencepool import inference_pool_problems
from tests.operator.operator_harness import Kube, spec_of
from tests.operator.test_operator_admission import condition, create_pool
from tests.support import wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GATEWAY_CRD = {
    # A stand-in for the inference extension's CRD (names only; any spec is stored).
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{GATEWAY_PLURAL}.{GATEWAY_GROUP}"},
    "spec": {
        "group": GATEWAY_GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "InferencePool",
            "listKind": "InferencePoolList",
            "plural": GATEWAY_PLURAL,
            "singular": "inferencepool",
            "shortNames": ["infpool"],
        },
        "versions": [
            {
                "name": GATEWAY_VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def example_pool() -> InferencePool:
    return InferencePool.from_body(
        yaml.safe_load((EXAMPLES / "smollm2-gateway-api.yaml").read_text())
    )


def test_the_object_follows_the_v1_api_and_selects_exactly_the_engines():
    pool = example_pool()
    obj = build_gateway_inference_pool(pool)
    assert inference_pool_problems(obj) == []
    template = build_deployment(pool, engine_image="e:1")["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = template["spec"]["containers"]
    assert (
        [p["number"] for p in obj["spec"]["targetPorts"]]
        == [p["containerPort"] for p in container["ports"]]
        == [8000]
    )
    ref = obj["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["portNumber"], ref["failureMode"]) == (
        "smollm2-epp",
        9002,
        "FailClose",
    )


def test_the_endpoint_picker_can_be_named():
    body = yaml.safe_load((EXAMPLES / "smollm2-gateway-api.yaml").read_text())
    body["spec"]["gatewayAPI"]["inferencePool"]["endpointPickerRef"] = {
        "name": "my-epp",
        "portNumber": 9100,
        "failureMode": "FailOpen",
    }
    obj = build_gateway_inference_pool(InferencePool.from_body(body))
    assert inference_pool_problems(obj) == []
    assert obj["spec"]["endpointPickerRef"]["name"] == "my-epp"


def test_the_check_refuses_what_v1_does_not_allow():
    obj = build_gateway_inference_pool(example_pool())
    spec = obj["spec"]
    broken = {
        **obj,
        "spec": {
            **spec,
            "selector": {"matchExpressions": []},
            "targetPorts": [{"number": 0}, {"number": 0}],
            "endpointPickerRef": {"failureMode": "Maybe"},
        },
    }
    problems = inference_pool_problems(broken)
    assert len(problems) >= 5, problems
    assert "endpointPickerRef is required" in inference_pool_problems(
        {**obj, "spec": {k: v for k, v in spec.items() if k != "endpointPickerRef"}}
    )


def gateway_pool(kube: Kube, name: str = "chat") -> dict[str, Any] | None:
    custom = kubernetes.client.CustomObjectsApi(kube.api_client)
    try:
        return cast(
            dict[str, Any],
            custom.get_namespaced_custom_object(
                GATEWAY_GROUP, GATEWAY_VERSION, "default", GATEWAY_PLURAL, name
            ),
        )
    except kubernetes.client.exceptions.ApiException:
        return None


@pytest.mark.parametrize("extra_crds", [[GATEWAY_CRD]])
@pytest.mark.usefixtures("operator")
def test_the_operator_creates_an_owned_gateway_api_inference_pool(kube: Kube):
    create_pool(kube, gatewayAPI={"inferencePool": {"enabled": True}})
    wait_until(lambda: gateway_pool(kube), 15, what="Gateway API InferencePool")
    obj = gateway_pool(kube)
    assert obj is not None and inference_pool_problems(obj) == []
    (owner,) = obj["metadata"]["ownerReferences"]
    assert owner["apiVersion"] == "slotserve.dev/v1alpha1" and owner["kind"] == "InferencePool"
    assert owner["uid"] == kube.get_pool("chat")["metadata"]["uid"]
    # Both kinds named InferencePool live side by side: ours still reconciles its engines.
    assert (
        kube.deployment("chat")["spec"]["selector"]["matchLabels"]
        == (obj["spec"]["selector"]["matchLabels"])
    )
    kube.patch_pool(
        "chat", {"spec": {"gatewayAPI": {"inferencePool": {"endpointPickerRef": {"name": "epp"}}}}}
    )
    wait_until(
        lambda: spec_of(gateway_pool(kube))["endpointPickerRef"]["name"] == "epp", 15, what="patch"
    )
    assert condition(kube, "Degraded")["status"] == "False"
    # Switched off, the object goes (a Gateway would otherwise keep routing around admission);
    # the pool's own engines stay.
    kube.patch_pool("chat", {"spec": {"gatewayAPI": {"inferencePool": {"enabled": False}}}})
    wait_until(lambda: gateway_pool(kube) is None, 15, what="Gateway API InferencePool deleted")
    assert kube.deployment("chat") is not None


@pytest.mark.usefixtures("operator")
def test_without_the_gateway_api_crd_the_pool_is_degraded(kube: Kube):
    create_pool(kube, gatewayAPI={"inferencePool": {"enabled": True}})
    wait_until(
        lambda: condition(kube, "Degraded").get("reason") == "GatewayAPINotInstalled",
        15,
        what="Degraded GatewayAPINotInstalled",
    )
    wait_until(
        lambda: any(e["reason"] == "GatewayAPINotInstalled" for e in kube.events()), 5, what="event"
    )
    # Turning it off recovers.
    kube.patch_pool("chat", {"spec": {"gatewayAPI": {"inferencePool": {"enabled": False}}}})
    wait_until(lambda: kube.deployments(), 15, what="children once the spec is fixed")


def test_the_route_examples_point_at_the_right_backends():
    routes = yaml.safe_load((EXAMPLES / "gateway-api-routes.yaml").read_text())
    assert routes["kind"] == "List"
    backends = {
        route["metadata"]["name"]: route["spec"]["rules"][0]["backendRefs"][0]
        for route in routes["items"]
    }
    direct = backends["smollm2-direct"]
    assert (direct["group"], direct["kind"], direct["name"]) == (
        GATEWAY_GROUP,
        "InferencePool",
        example_pool().metadata.name,
    )
    via = backends["slotserve-gateway"]
    assert via.get("kind", "Service") == "Service" and via["port"] == 80
