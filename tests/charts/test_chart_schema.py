"""Bad values are refused by helm itself (values.schema.json or a template `fail`), clearly."""

from __future__ import annotations

import json

import pytest

from tests.charts.chart_support import CHART, VALUES_DIR, template_args

# values file -> what helm's error must say (the path of the offending value, or our message).
BAD_VALUES = {
    "bad-negative-replicas.yaml": "/gateway/replicas': minimum: got -1",
    "bad-replicas-string.yaml": "/gateway/replicas': got string, want integer",
    "bad-both-redis.yaml": "/redis/bundled/enabled': value must be false",
    "bad-no-redis.yaml": "/redis/bundled/enabled': value must be true",
    "bad-redis-url-password.yaml": "/redis/external/url'",
    "bad-unknown-key.yaml": "additional properties 'replica' not allowed",
    "bad-service-type.yaml": "/gateway/service/type'",
    "bad-namespace.yaml": "/watchNamespaces/0'",
    "bad-pull-policy.yaml": "/operator/image/pullPolicy'",
    "bad-hpa-bounds.yaml": "maxReplicas must be >= gateway.autoscaling.minReplicas",
    "bad-enabled-type.yaml": "/networkPolicy/enabled': got string, want boolean",
    "bad-both-redis-urls.yaml": "at '/redis': 'not' failed",
    "bad-tenant-weight.yaml": "/gateway/apiKeys/keys/0'",
    "bad-tenant-option.yaml": "/gateway/apiKeys/keys/0'",
}


def test_every_bad_values_file_is_covered():
    on_disk = {p.name for p in VALUES_DIR.glob("bad-*.yaml")}
    assert on_disk == set(BAD_VALUES)


@pytest.mark.parametrize("values_file", sorted(BAD_VALUES))
def test_bad_values_are_rejected_with_a_message(run_helm, values_file):
    result = run_helm(template_args([values_file]))
    assert result.returncode != 0, f"helm accepted {values_file}"
    assert BAD_VALUES[values_file] in result.stderr, result.stderr
    assert result.stdout.strip() == "", "nothing may be rendered from bad values"


@pytest.mark.parametrize(
    ("set_value", "expected"),
    [
        ("redis.external.url=redis://r.example:6379", "not both"),
        ("redis.bundled.enabled=false", "the gateway needs Redis"),
        ("redis.external.urlSecret=redis-url", "not both"),
    ],
)
def test_redis_choice_holds_without_the_schema(run_helm, set_value, expected):
    """`--skip-schema-validation` must not let both (or no) Redis modes through."""
    result = run_helm(template_args([], ["--skip-schema-validation", "--set", set_value]))
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


def test_schema_rejects_unknown_keys_except_kubernetes_passthroughs():
    """Typos fail (additionalProperties=false), except where Kubernetes fields pass through."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: dict, path: str) -> None:
        if "properties" not in node:
            return
        where = path or "/"
        assert "additionalProperties" in node, f"{where} does not say whether it takes other keys"
        if node["additionalProperties"] is not False:
            open_objects.append(where)
        for key, child in node["properties"].items():
            walk(child, f"{path}/{key}")

    walk(schema, "")
    assert sorted(open_objects) == [
        "/containerSecurityContext",
        "/containerSecurityContext/capabilities",
        "/podSecurityContext",
        "/podSecurityContext/seccompProfile",
    ]
