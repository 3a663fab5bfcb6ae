"""The built-in autoscaler's decisions and the autoscaling spec's rules, without services."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slotserve.admission_stats import WindowSummary
from slotserve.operator.admission import AdmissionReading
from slotserve.operator.autoscaler import ScalePolicy, Stabilizer, demand_of, recommend
from slotserve.operator.crd import build_crd
from slotserve.operator.models import AutoscalingSpec

POLICY = ScalePolicy(min_replicas=0, max_replicas=5, target=4, up_window_s=0, down_window_s=30)


def reading(queued=0, in_flight=0, recent=None) -> AdmissionReading:
    return AdmissionReading(queued, in_flight, WindowSummary(0, {}, None, recent or {}))


@pytest.mark.parametrize(
    ("demand", "replicas"), [(0, 0), (1, 1), (4, 1), (5, 2), (17, 5), (1000, 5)]
)
def test_replicas_are_demand_over_target_within_bounds(demand, replicas):
    assert recommend(demand, POLICY) == replicas


def test_demand_counts_waiting_running_and_a_refusal_for_lack_of_an_engine():
    assert demand_of(reading(queued=3, in_flight=2)) == 5
    assert demand_of(reading(recent={"no_ready_endpoint": 7})) == 1  # wakes a pool at zero
    assert demand_of(reading(recent={"queue_full": 7})) == 0


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window():
    stabilizer = Stabilizer()
    assert stabilizer.desired(0, recommend(1, POLICY), 0, POLICY) == 1  # 0 -> 1 at once
    assert stabilizer.desired(1, recommend(20, POLICY), 1, POLICY) == 5
    # Demand gone: the window still holds a recommendation of 5.
    for t in range(2, 31):
        assert stabilizer.desired(t, 0, 5, POLICY) == 5
    assert stabilizer.desired(32, 0, 5, POLICY) == 0


def test_scale_down_goes_to_the_highest_recommendation_of_the_window():
    stabilizer = Stabilizer()
    stabilizer.desired(0, 4, 5, POLICY)
    stabilizer.desired(10, 2, 5, POLICY)
    assert stabilizer.desired(20, 1, 5, POLICY) == 4
    assert stabilizer.desired(35, 1, 4, POLICY) == 2  # the 4 left the window


def test_scale_up_window_takes_the_lowest_recommendation():
    policy = ScalePolicy(0, 10, 1, up_window_s=10, down_window_s=0)
    stabilizer = Stabilizer()
    stabilizer.desired(0, 2, 1, policy)
    assert stabilizer.desired(5, 8, 1, policy) == 2  # a spike alone does not scale to 8
    assert stabilizer.desired(11, 8, 2, policy) == 8


def test_replicas_outside_the_bounds_are_brought_inside():
    stabilizer = Stabilizer()
    assert stabilizer.desired(0, 5, 9, POLICY) == 5


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"minReplicas": 3, "maxReplicas": 2}, "minReplicas must not exceed maxReplicas"),
        ({"maxReplicas": 2, "provider": "keda"}, "provider keda needs keda.serverAddress"),
        ({"maxReplicas": 2, "scaleDownWindowSeconds": -1}, "greater than or equal to 0"),
        ({"maxReplicas": 2, "scaleUpWindowSeconds": -5}, "greater than or equal to 0"),
        ({"maxReplicas": 0}, "greater than or equal to 1"),
    ],
)
def test_specs_that_cannot_work_are_refused(spec, message):
    with pytest.raises(ValidationError, match=message):
        AutoscalingSpec.model_validate(spec)


def test_the_crd_carries_the_same_rules():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    autoscaling = schema["properties"]["spec"]["properties"]["autoscaling"]
    rules = {rule["rule"] for rule in autoscaling["x-kubernetes-validations"]}
    assert rules == {
        "self.minReplicas <= self.maxReplicas",
        "self.provider != 'keda' || has(self.keda)",
    }
    properties = autoscaling["properties"]
    assert properties["minReplicas"]["minimum"] == 0  # scale to zero allowed
    assert properties["scaleUpWindowSeconds"]["minimum"] == 0
    assert properties["scaleDownWindowSeconds"]["minimum"] == 0
    assert autoscaling["required"] == ["maxReplicas"]


def keda_pool(**autoscaling):
    from slotserve.operator.models import InferencePool

    return InferencePool.from_body(
        {
            "metadata": {"name": "chat", "namespace": "ml"},
            "spec": {
                "model": {"name": "team/chat", "source": {"builtin": "smollm2"}},
                "batching": {"maxBatchSize": 8},
                "autoscaling": {
                    "provider": "keda",
                    "maxReplicas": 4,
                    "keda": {"serverAddress": "http://prometheus:9090"},
                    **autoscaling,
                },
            },
        }
    )


def test_scaled_object_follows_keda_s_documented_spec():
    from slotserve.operator.crd import build_crd
    from slotserve.operator.keda import build_scaled_object
    from tests.operator.keda_scaledobject import scaled_object_problems

    obj = build_scaled_object(keda_pool(minReplicas=0, scaleDownWindowSeconds=3600))
    assert scaled_object_problems(obj, "ml") == []
    spec = obj["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 4)
    (trigger,) = spec["triggers"]
    assert trigger["metadata"]["threshold"] == "8"  # default target: the pool's slots
    assert trigger["metadata"]["activationThreshold"] == "0"  # any demand wakes it from zero
    # The target is the pool's scale subresource, which KEDA needs for a custom resource.
    version = build_crd()["spec"]["versions"][0]
    assert "scale" in version["subresources"]
    assert spec["scaleTargetRef"]["kind"] == build_crd()["spec"]["names"]["kind"]
    # The check itself refuses what KEDA's spec does not allow.
    broken = {**obj, "spec": {**spec, "minReplicaCount": 5, "idleReplicaCount": 6, "extra": 1}}
    broken["spec"]["triggers"] = [{"type": "prometheus", "metadata": {"query": "x"}}]
    assert len(scaled_object_problems(broken, "ml")) >= 5


def test_scaled_object_query_uses_only_metrics_the_gateway_exports():
    import re

    from slotserve.gateway.http.metrics import GatewayMetrics
    from slotserve.operator.keda import demand_query

    query = demand_query('team/"chat"')
    assert 'pool="team/\\"chat\\""' in query  # label values escaped
    from tests.metric_registry import series_names

    exported = series_names(GatewayMetrics().registry)
    names = set(re.findall(r"(slotserve_[a-z_]+)\{", query))
    assert names and names <= exported, names - exported
