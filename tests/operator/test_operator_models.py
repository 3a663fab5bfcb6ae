"""The pydantic models mirror the CRD's CEL rules, so the operator rejects what CEL would."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from slotserve.operator import crd
from slotserve.operator.models import InferencePool, InferencePoolSpec
from slotserve.operator.settings import OperatorSettings


def spec(**fields: Any) -> dict[str, Any]:
    return {"model": {"name": "smollm2", "source": {"builtin": "smollm2"}}, **fields}


def test_defaults_fill_a_minimal_spec():
    parsed = InferencePoolSpec.model_validate(spec())
    assert parsed.replicas == 1
    assert parsed.batching.policy == "continuous"
    assert parsed.batching.max_batch_size == 32
    assert parsed.admission.max_queue_size == 256
    assert parsed.model.dtype == "auto"
    assert parsed.model.quantization == "none"


def test_an_unknown_quantization_names_the_field_and_the_choices():
    model = {"name": "m", "source": {"builtin": "smollm2"}, "quantization": "int3"}
    with pytest.raises(ValidationError, match=r"model\.quantization\n.*'none', 'int8' or 'int4'"):
        InferencePoolSpec.model_validate({"model": model})


@pytest.mark.parametrize(
    "source",
    [
        {},
        {"builtin": "smollm2", "hostPath": {"path": "/m"}},
        {"pvc": {"claimName": "m", "path": "../x"}},
    ],
)
def test_model_source_must_be_exactly_one_valid_member(source: dict[str, Any]):
    with pytest.raises(ValidationError):
        InferencePoolSpec.model_validate({"model": {"name": "m", "source": source}})


def test_preferred_batch_sizes_must_fit_max_batch_size():
    with pytest.raises(ValidationError, match="preferredBatchSizes"):
        InferencePoolSpec.model_validate(
            spec(batching={"maxBatchSize": 8, "preferredBatchSizes": [4, 16]})
        )


def test_gpu_requests_must_equal_limits():
    with pytest.raises(ValidationError, match=r"nvidia\.com/gpu"):
        InferencePoolSpec.model_validate(
            spec(engine={"resources": {"requests": {"nvidia.com/gpu": 1}}})
        )
    ok = spec(engine={"resources": {"limits": {"nvidia.com/gpu": 1}}})
    assert InferencePoolSpec.model_validate(ok).engine.resources.limits == {"nvidia.com/gpu": 1}


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError, match="gpus"):
        InferencePoolSpec.model_validate(spec(engine={"gpus": 1}))


@pytest.mark.parametrize("quantity", ["500m", "2Gi", 3, "1e3"])
def test_resource_quantities_are_accepted(quantity: Any):
    parsed = InferencePoolSpec.model_validate(
        spec(engine={"resources": {"limits": {"cpu": quantity}}})
    )
    assert parsed.engine.resources.limits == {"cpu": quantity}


@pytest.mark.parametrize("quantity", ["two", "1 Gi", 1.5])
def test_resource_quantities_are_checked(quantity: Any):
    with pytest.raises(ValidationError, match="limits"):
        InferencePoolSpec.model_validate(spec(engine={"resources": {"limits": {"cpu": quantity}}}))


def test_pool_from_api_body_ignores_server_metadata():
    body = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u",
            "generation": 3,
            "managedFields": [],
        },
        "spec": spec(),
        "status": {"anything": True},
    }
    pool = InferencePool.from_body(body)
    assert (pool.metadata.name, pool.metadata.namespace, pool.metadata.generation) == ("p", "ns", 3)


def test_operator_settings_from_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLOTSERVE_OPERATOR_NAMESPACES", "a, b,")
    monkeypatch.setenv("SLOTSERVE_OPERATOR_HEALTH_PORT", "9090")
    settings = OperatorSettings()
    assert settings.namespaces == ["a", "b"]
    assert settings.health_port == 9090
    assert settings.engine_image == "ghcr.io/slotserve/engine:0.1.0"


def test_node_selector_keys_and_values_are_checked():
    with pytest.raises(ValidationError, match="nodeSelector key"):
        InferencePoolSpec.model_validate(spec(engine={"nodeSelector": {"bad key!": "x"}}))
    with pytest.raises(ValidationError):
        InferencePoolSpec.model_validate(spec(engine={"nodeSelector": {"zone": "bad value!"}}))
    ok = {"nodeSelector": {"nvidia.com/gpu.present": "true"}, "podAnnotations": {"a/b": "c"}}
    assert InferencePoolSpec.model_validate(spec(engine=ok)).engine.node_selector


def test_device_cuda_needs_a_gpu_in_the_limits():
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    with pytest.raises(ValidationError, match="device cuda needs resources"):
        InferencePoolSpec.model_validate(spec(engine={"device": "cuda"}))
    assert InferencePoolSpec.model_validate(spec(engine={"device": "cuda", "resources": gpu}))
    assert InferencePoolSpec.model_validate(spec()).engine.device == "auto"
    # The same rule in the CRD, for the API server (CEL).
    engine = crd.openapi_schema()["properties"]["spec"]["properties"]["engine"]
    (rule,) = engine["x-kubernetes-validations"]
    assert "self.device != 'cuda'" in rule["rule"] and "nvidia.com/gpu" in rule["rule"]
    assert engine["properties"]["device"]["enum"] == ["auto", "cpu", "cuda"]


def test_prefix_cache_rows_must_give_every_slot_a_row():
    with pytest.raises(ValidationError, match="prefixCacheRows must be 0 or at least"):
        InferencePoolSpec.model_validate(
            spec(batching={"maxBatchSize": 8}, engine={"prefixCacheRows": 4})
        )
    with pytest.raises(ValidationError, match="prefixCacheRows must be 0 or at least"):
        InferencePoolSpec.model_validate(spec(engine={"prefixCacheRows": 31}))  # 32 slots
    with pytest.raises(ValidationError, match="less than or equal to 4096"):
        InferencePoolSpec.model_validate(spec(engine={"prefixCacheRows": 10**9}))
    for rows in (0, 8, 24):
        parsed = InferencePoolSpec.model_validate(
            spec(batching={"maxBatchSize": 8}, engine={"prefixCacheRows": rows})
        )
        assert parsed.engine.prefix_cache_rows == rows
    # The same rule in the CRD, for the API server (CEL), read with the defaults it applies.
    (rule,) = crd.openapi_schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert "self.engine.prefixCacheRows >= " in rule["rule"] and ": 32)" in rule["rule"]
