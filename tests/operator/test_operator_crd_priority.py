"""The priority fields of spec.admission (Triton's names, camelCase) in the CRD and the models,
and what the gateway makes of them."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from slotserve.gateway.admission.types import LevelPolicy, PoolPolicy
from slotserve.operator import crd, models
from tests.operator.test_operator_crd import pool, validator

ADMISSION = {
    "maxQueueSize": 100,
    "queueTimeoutSeconds": 20,
    "priorityLevels": 5,
    "defaultPriorityLevel": 3,
    "priorityAgingSeconds": 1.5,
    "priorityQueuePolicy": {
        "1": {"maxQueueSize": 10, "queueTimeoutSeconds": 2},
        "5": {"timeoutAction": "DELAY"},
    },
}


def test_priority_fields_pass_the_schema_and_reach_the_gateways_policy():
    body = pool(admission=ADMISSION)
    validator().validate(body)
    spec = models.InferencePool.from_body(body).spec
    policy = PoolPolicy.from_specs("smollm2", spec.admission)
    assert policy.priority_levels == 5 and policy.default_priority_level == 3
    assert policy.priority_aging_s == 1.5
    assert policy.level(1) == LevelPolicy(10, 2, "REJECT")
    assert policy.level(5) == LevelPolicy(100, 20, "DELAY")  # the pool's values filled in
    assert policy.level(3) == LevelPolicy(100, 20, "REJECT")


def test_cel_rules_mirror_the_models_checks():
    admission = crd.openapi_schema()["properties"]["spec"]["properties"]["admission"]
    rules = " ".join(rule["rule"] for rule in admission["x-kubernetes-validations"])
    assert "self.defaultPriorityLevel <= self.priorityLevels" in rules
    assert "int(level) <= self.priorityLevels" in rules
    assert admission["properties"]["priorityQueuePolicy"]["maxProperties"] == 9


@pytest.mark.parametrize(
    "admission",
    [
        {"priorityLevels": 3, "defaultPriorityLevel": 4},
        {"priorityLevels": 3, "priorityQueuePolicy": {"4": {}}},
        {"priorityQueuePolicy": {"0": {}}},
        {"priorityQueuePolicy": {"x": {}}},
    ],
)
def test_the_models_refuse_levels_out_of_range(admission: dict[str, Any]):
    with pytest.raises(pydantic.ValidationError):
        models.InferencePool.from_body(pool(admission=admission))


@pytest.mark.parametrize(
    ("admission", "where"),
    [
        ({"priorityQueuePolicy": {"1": {"timeoutAction": "DROP"}}}, "timeoutAction"),
        ({"priorityLevels": 10}, "priorityLevels"),
        ({"priorityQueuePolicy": {"1": {"queueTimeoutSeconds": 0}}}, "queueTimeoutSeconds"),
    ],
)
def test_the_schema_refuses_bad_values(admission: dict[str, Any], where: str):
    errors = list(validator().iter_errors(pool(admission=admission)))
    assert any(where in (str(list(e.absolute_path)) + e.message) for e in errors), errors
