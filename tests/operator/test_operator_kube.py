"""The pure parts of the I/O layer and the CLI: diffing, merge patches, settings, RBAC shape."""

from __future__ import annotations

import pytest

from slotserve.operator import cli, rbac
from slotserve.operator.kube import is_subset, replacing_patch
from slotserve.operator.settings import OperatorSettings
from tests.kubeapi import merge_patch


def test_is_subset_ignores_server_added_fields_but_not_differences():
    live = {"a": 1, "b": {"c": [{"x": 1, "y": 2}], "d": "server default"}}
    assert is_subset({"b": {"c": [{"x": 1}]}}, live)
    assert not is_subset({"b": {"c": [{"x": 2}]}}, live)
    assert not is_subset({"b": {"c": [{"x": 1}, {"x": 1}]}}, live)
    assert not is_subset({"e": 1}, live)


def test_replacing_patch_removes_what_desired_no_longer_has():
    live = {"nodeSelector": {"zone": "a", "pool": "p"}, "containers": [{"name": "x"}], "old": 1}
    desired = {"nodeSelector": {"pool": "p"}, "containers": [{"name": "y"}]}
    patch = replacing_patch(live, desired)
    assert patch == {
        "old": None,
        "nodeSelector": {"zone": None, "pool": "p"},
        "containers": [{"name": "y"}],
    }
    assert merge_patch(live, patch) == desired  # RFC 7386 merge-patch semantics


def test_cli_scope_and_peering():
    clusterwide = cli.operator_kwargs(OperatorSettings())
    assert clusterwide["clusterwide"] is True and "namespaces" not in clusterwide
    assert clusterwide["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert "peering_name" not in clusterwide

    scoped = cli.operator_kwargs(
        OperatorSettings(namespaces=["ml", "prod"], peering_name="slotserve", health_port=9000)
    )
    assert scoped["namespaces"] == ["ml", "prod"] and "clusterwide" not in scoped
    assert scoped["peering_name"] == "slotserve" and scoped["priority"] >= 1
    assert scoped["liveness_endpoint"].endswith(":9000/healthz")


def test_cli_help_and_bad_flags():
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert cli.main(["--health-port", "0"]) == 2


def test_rbac_rules_are_well_formed_and_least_privilege():
    for rule in rbac.REQUIRED_RULES:
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    verbs = {
        (group, resource): set(rule["verbs"])
        for rule in rbac.REQUIRED_RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert verbs[("", "pods")] == {"get", "list", "watch"}  # engine pods are only read
    assert "delete" not in verbs[("apps", "deployments")]  # the garbage collector deletes
    assert {"patch"} <= verbs[("slotserve.dev", "inferencepools/status")]
