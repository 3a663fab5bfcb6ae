"""The rendered RBAC grants exactly what the operator and the gateway call, in both RBAC modes."""

from __future__ import annotations

from typing import Any

import pytest

from slotserve.gateway.pools.discovery import REQUIRED_RULES as GATEWAY_RULES
from slotserve.operator.rbac import REQUIRED_RULES
from tests.charts.chart_support import NAMESPACE, RELEASE

OPERATOR = f"{RELEASE}-slotserve-operator"
GATEWAY = f"{RELEASE}-slotserve-gateway"
CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}

Grant = tuple[str, str, str]


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    """Rules as (apiGroup, resource, verb) triples: equal sets mean equal permissions."""
    out: set[Grant] = set()
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    out.add((group, resource, verb))
    return out


GATEWAY_GRANTS = grants(GATEWAY_RULES)


def bound_subject(binding: dict[str, Any]) -> tuple[str, str]:
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    return subject["name"], subject["namespace"]


def test_required_rules_name_real_permissions():
    assert grants(REQUIRED_RULES), "REQUIRED_RULES is empty"


def test_cluster_wide_operator_role_equals_required_rules(render):
    rendered = render()
    role = rendered.get("ClusterRole", OPERATOR)
    assert grants(role["rules"]) == grants(REQUIRED_RULES)
    binding = rendered.get("ClusterRoleBinding", OPERATOR)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": OPERATOR,
    }
    assert bound_subject(binding) == (OPERATOR, NAMESPACE)
    deployment = rendered.get("Deployment", OPERATOR)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == OPERATOR
    assert rendered.has("ServiceAccount", OPERATOR)
    assert not rendered.of_kind("Role")


def test_gateway_only_reads_pools_and_their_endpoint_slices(render):
    assert {verb for _, _, verb in GATEWAY_GRANTS} <= {"get", "list", "watch"}
    rendered = render()
    assert grants(rendered.get("ClusterRole", GATEWAY)["rules"]) == GATEWAY_GRANTS
    assert bound_subject(rendered.get("ClusterRoleBinding", GATEWAY)) == (GATEWAY, NAMESPACE)
    deployment = rendered.get("Deployment", GATEWAY)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == GATEWAY
    assert rendered.has("ServiceAccount", GATEWAY)


def test_namespaced_rbac_splits_required_rules_by_scope(render):
    rendered = render("namespaced-rbac.yaml")
    required = grants(REQUIRED_RULES)
    cluster_part = grants(rendered.get("ClusterRole", OPERATOR)["rules"])
    assert {resource for _, resource, _ in cluster_part} <= CLUSTER_SCOPED
    for namespace in ("team-a", "team-b"):
        role = rendered.get("Role", OPERATOR, namespace)
        namespaced_part = grants(role["rules"])
        assert not {resource for _, resource, _ in namespaced_part} & CLUSTER_SCOPED
        # Together the two grant exactly REQUIRED_RULES, nothing more, nothing less.
        assert cluster_part | namespaced_part == required
        binding = rendered.get("RoleBinding", OPERATOR, namespace)
        assert binding["roleRef"]["name"] == OPERATOR
        assert binding["roleRef"]["kind"] == "Role"
        assert bound_subject(binding) == (OPERATOR, NAMESPACE)
        assert grants(rendered.get("Role", GATEWAY, namespace)["rules"]) == GATEWAY_GRANTS
        assert bound_subject(rendered.get("RoleBinding", GATEWAY, namespace)) == (
            GATEWAY,
            NAMESPACE,
        )
    # The gateway gets no cluster-wide access at all in this mode.
    assert not rendered.has("ClusterRole", GATEWAY)
    assert not rendered.has("ClusterRoleBinding", GATEWAY)
    assert {role["metadata"]["namespace"] for role in rendered.of_kind("Role")} == {
        "team-a",
        "team-b",
    }


@pytest.mark.parametrize("values_files", [(), ("namespaced-rbac.yaml",)])
def test_watched_namespaces_reach_both_processes(render, values_files):
    rendered = render(*values_files)
    expected = "team-a,team-b" if values_files else ""
    for name, variable in [
        (OPERATOR, "SLOTSERVE_OPERATOR_NAMESPACES"),
        (GATEWAY, "SLOTSERVE_GATEWAY_NAMESPACES"),
    ]:
        (container,) = rendered.get("Deployment", name)["spec"]["template"]["spec"]["containers"]
        env = {var["name"]: var.get("value") for var in container["env"]}
        assert env[variable] == expected


def test_rbac_can_be_left_to_the_user(render):
    rendered = render(extra=["--set", "rbac.create=false"])
    kinds = {obj["kind"] for obj in rendered.objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
