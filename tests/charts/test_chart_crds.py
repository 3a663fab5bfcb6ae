"""The chart ships the very CRD in crds/ (Helm installs it; upgrades are `kubectl apply`)."""

from __future__ import annotations

from tests.charts.chart_support import CHART, ROOT, load_yaml

CRD_FILE = "inferencepools.slotserve.dev.yaml"


def test_chart_crd_is_a_byte_for_byte_copy_of_crds_dir():
    source = ROOT / "crds" / CRD_FILE
    copy = CHART / "crds" / CRD_FILE
    assert copy.read_bytes() == source.read_bytes(), (
        f"charts/slotserve/crds/{CRD_FILE} drifted from crds/{CRD_FILE}: "
        f"run `cp crds/{CRD_FILE} charts/slotserve/crds/`"
    )


def test_chart_ships_only_slotserve_crds():
    shipped = sorted(p.name for p in (CHART / "crds").iterdir())
    upstream = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert shipped == upstream


def test_include_crds_renders_the_inferencepool_crd(render):
    (crd,) = render().of_kind("CustomResourceDefinition")
    assert crd == load_yaml(ROOT / "crds" / CRD_FILE)
    assert crd["metadata"]["name"] == "inferencepools.slotserve.dev"
    assert crd["spec"]["group"] == "slotserve.dev"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def test_gateway_and_operator_rbac_name_the_crd_resource(render):
    (crd,) = render().of_kind("CustomResourceDefinition")
    plural = crd["spec"]["names"]["plural"]
    for role in render().of_kind("ClusterRole"):
        resources = {r for rule in role["rules"] for r in rule["resources"]}
        assert plural in resources, role["metadata"]["name"]
