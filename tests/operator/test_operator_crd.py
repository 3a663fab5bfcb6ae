"""The generated CRD: committed file in sync with the models, valid, and accepting the examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from slotserve.contracts.crd import API_VERSION, KIND
from slotserve.operator import crd, models

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferencepools.slotserve.dev.yaml"
# Example InferencePools (examples/ also holds other files, e.g. a local gateway pool file).
EXAMPLES = [
    path
    for path in sorted((ROOT / "examples").glob("*.yaml"))
    if (yaml.safe_load(path.read_text()) or {}).get("kind") == KIND
]
K8S_VERSION = "1.37.0"


def closed_schema(node: Any) -> Any:
    """The openAPIV3Schema with unknown fields rejected instead of pruned, to catch typos."""
    if isinstance(node, dict):
        node = {key: closed_schema(value) for key, value in node.items()}
        if "properties" in node and node.get("properties") and "metadata" not in node["properties"]:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [closed_schema(item) for item in node]
    return node


def validator() -> jsonschema.Validator:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    # OpenAPI 3.0 schemas use draft 4's boolean exclusiveMinimum; x-kubernetes-* are ignored.
    return jsonschema.Draft4Validator(closed_schema(schema))


def pool(**spec: Any) -> dict[str, Any]:
    base = {"model": {"name": "smollm2", "source": {"builtin": "smollm2"}}}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "p"},
        "spec": {**base, **spec},
    }


def test_committed_crd_matches_the_models():
    # Regenerate with: python -m slotserve.operator.crd > crds/inferencepools.slotserve.dev.yaml
    assert CRD_FILE.read_text() == crd.render_crd_yaml()


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), K8S_VERSION, strict=True)


def test_crd_names_subresources_and_columns():
    body = yaml.safe_load(CRD_FILE.read_text())
    assert body["metadata"]["name"] == "inferencepools.slotserve.dev"
    assert body["spec"]["names"]["shortNames"] == ["ipool"]
    version = body["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] is True
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Policy", "Ready", "Desired", "Queued", "In-Flight", "Age"]
    # kubectl get ipool: QUEUED and IN-FLIGHT from status.admission (empty without Redis).
    assert columns["Queued"] == ".status.admission.queued"
    assert columns["In-Flight"] == ".status.admission.inFlight"


def test_schema_is_structural():
    """Every node has a type (or is int-or-string); no $ref, anyOf-with-types, null or const."""

    def walk(node: dict[str, Any], path: str) -> None:
        assert "$ref" not in node and "const" not in node and "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            return
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            path
        )
        assert not ("properties" in node and "additionalProperties" in node), path
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.*")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(crd.openapi_schema(), "")


def test_schema_carries_defaults_bounds_enums_and_cel_rules():
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    batching = spec["batching"]
    assert batching["default"] == {}
    assert batching["properties"]["policy"]["enum"] == ["static", "dynamic", "continuous"]
    assert batching["properties"]["policy"]["default"] == "continuous"
    assert batching["properties"]["maxBatchSize"]["minimum"] == 1
    assert batching["properties"]["preferredBatchSizes"]["maxItems"] == 64
    rules = [rule["rule"] for rule in batching["x-kubernetes-validations"]]
    assert any("self.maxBatchSize" in rule for rule in rules)
    source = spec["model"]["properties"]["source"]
    assert "size() == 1" in source["x-kubernetes-validations"][0]["rule"]
    timeout = spec["admission"]["properties"]["queueTimeoutSeconds"]
    assert timeout["minimum"] == 0 and timeout["exclusiveMinimum"] is True


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_examples_pass_the_crd_schema_and_the_models(path: Path):
    body = yaml.safe_load(path.read_text())
    validator().validate(body)
    parsed = models.InferencePool.from_body(body)
    assert parsed.spec.model.name


def test_there_are_examples():
    assert {path.name for path in EXAMPLES} >= {"smollm2-cpu.yaml", "llama-8b-gpu.yaml"}


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"replicas": -1}, "replicas"),
        ({"batching": {"policy": "greedy"}}, "policy"),
        ({"batching": {"maxBatchSize": 0}}, "maxBatchSize"),
        ({"admission": {"queueTimeoutSeconds": 0}}, "queueTimeoutSeconds"),
        ({"engine": {"resources": {"limits": {"cpu": "two"}}}}, "limits"),
        ({"engine": {"tolerations": [{"operator": "Maybe"}]}}, "operator"),
        ({"model": {"name": "-bad", "source": {"builtin": "smollm2"}}}, "name"),
        ({"model": {"name": "m", "source": {"builtin": "gpt-5"}}}, "builtin"),
        ({"engine": {"gpus": 1}}, "gpus"),
        (
            {"model": {"name": "m", "source": {"builtin": "smollm2"}, "quantization": "int3"}},
            "quantization",
        ),
    ],
)
def test_schema_rejects_invalid_specs(spec: dict[str, Any], where: str):
    errors = list(validator().iter_errors(pool(**spec)))
    assert errors, f"{spec} was accepted"
    assert any(where in (str(list(error.absolute_path)) + error.message) for error in errors)


def test_schema_accepts_the_smallest_pool():
    validator().validate(pool())


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_schema_accepts_each_quantization(quantization: str):
    model = {"name": "m", "source": {"builtin": "smollm2"}, "quantization": quantization}
    validator().validate(pool(model=model))
