"""The chart's env and args are what the real gateway and operator parse, value by value."""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any, TypeVar

import pytest
from pydantic_settings import BaseSettings

from slotserve.gateway.cli import build_parser as gateway_parser
from slotserve.gateway.settings import GatewaySettings
from slotserve.operator.cli import build_parser as operator_parser
from slotserve.operator.settings import OperatorSettings
from slotserve.settings import settings_from_args
from tests.charts.chart_support import GOOD_VALUES, RELEASE, Rendered

SettingsT = TypeVar("SettingsT", bound=BaseSettings)
GATEWAY = f"{RELEASE}-slotserve-gateway"
OPERATOR = f"{RELEASE}-slotserve-operator"
SECRET_VALUE = "s3cret-from-secret"
SECRET_URL = f"rediss://slotserve:{SECRET_VALUE}@redis.example.internal:6380/1"
ALL_RENDERS = [(), *((name,) for name in GOOD_VALUES)]


def container_of(rendered: Rendered, name: str) -> dict[str, Any]:
    (container,) = rendered.get("Deployment", name)["spec"]["template"]["spec"]["containers"]
    return container


def resolved_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the process sees: Secret refs filled in, $(VAR) expanded like kubelet."""
    env: dict[str, str] = {}
    for var in container["env"]:
        if "valueFrom" in var:
            assert set(var["valueFrom"]) == {"secretKeyRef"}, var
            # A Secret holding a whole Redis URL (redis.external.urlSecret) holds a URL.
            is_url = var["name"].endswith("_URL")
            env[var["name"]] = SECRET_URL if is_url else SECRET_VALUE
        else:
            env[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m[1], m[0]),
                var["value"],
            )
    return env


def settings_seen_by(
    container: dict[str, Any], cls: type[SettingsT], parser: Any, prefix: str, monkeypatch
) -> SettingsT:
    env = resolved_env(container)
    # extra="ignore" would silently drop a misspelt variable: every one must name a field.
    for name in env:
        if name.startswith(prefix):
            field = name.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{name} is not a setting of {cls.__name__}"
    for name in [n for n in os.environ if n.startswith("SLOTSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _command, *flags = container["args"]
    args = parser().parse_args(flags)
    return settings_from_args(cls, args)


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=lambda v: "+".join(v) or "defaults")
def test_gateway_settings_parse_from_the_rendered_pod(render, values_files, monkeypatch):
    rendered = render(*values_files)
    container = container_of(rendered, GATEWAY)
    assert container["args"][0] == "gateway"
    settings = settings_seen_by(
        container, GatewaySettings, gateway_parser, "SLOTSERVE_GATEWAY_", monkeypatch
    )
    assert settings.discovery == "kubernetes"
    assert settings.port == container["ports"][0]["containerPort"]
    assert settings.redis_url and settings.redis_url.startswith(("redis://", "rediss://"))
    if "external-redis.yaml" in values_files:
        assert f":{SECRET_VALUE}@" in settings.redis_url
    expected_namespaces = ["team-a", "team-b"] if "namespaced-rbac.yaml" in values_files else []
    assert settings.namespaces == expected_namespaces
    assert (settings.api_keys_file is not None) == (
        values_files in {("api-keys.yaml",), ("api-keys-tenants.yaml",), ("operator-ha.yaml",)}
    )


@pytest.mark.parametrize("values_files", ALL_RENDERS, ids=lambda v: "+".join(v) or "defaults")
def test_operator_settings_parse_from_the_rendered_pod(render, values_files, monkeypatch):
    rendered = render(*values_files)
    container = container_of(rendered, OPERATOR)
    assert container["args"][0] == "operator"
    settings = settings_seen_by(
        container, OperatorSettings, operator_parser, "SLOTSERVE_OPERATOR_", monkeypatch
    )
    assert settings.health_port == container["ports"][0]["containerPort"]
    assert settings.engine_image == "ghcr.io/slotserve/engine:0.1.0"
    expected_namespaces = ["team-a", "team-b"] if "namespaced-rbac.yaml" in values_files else []
    assert settings.namespaces == expected_namespaces
    expected_peering = OPERATOR if "operator-ha.yaml" in values_files else ""
    assert settings.peering_name == expected_peering


def test_gateway_redis_url_reaches_the_bundled_redis_service(render):
    rendered = render()
    env = resolved_env(container_of(rendered, GATEWAY))
    url = urllib.parse.urlsplit(env["SLOTSERVE_GATEWAY_REDIS_URL"])
    assert url.scheme == "redis" and url.password == SECRET_VALUE  # from the password Secret
    service = rendered.get("Service", url.hostname)
    assert url.port in [p["port"] for p in service["spec"]["ports"]]


def test_gateway_limits_and_model_namespaces_reach_the_gateway(render, tmp_path, monkeypatch):
    """The chart's gateway.limits and gateway.modelNamespaces arrive as the settings they name;
    unset, the gateway's own defaults hold (the budget derived from the container's memory)."""
    defaults = settings_seen_by(
        container_of(render(), GATEWAY), GatewaySettings, gateway_parser, "SLOTSERVE_GATEWAY_",
        monkeypatch,
    )  # fmt: skip
    assert defaults.memory_budget_bytes is None
    assert defaults.model_namespaces == {}
    assert defaults.max_json_nodes == GatewaySettings.model_fields["max_json_nodes"].default
    values = tmp_path / "limits.yaml"
    values.write_text(
        "gateway:\n"
        "  limits:\n"
        "    memoryBudgetBytes: 268435456\n"
        "    memoryBudgetFraction: 0.25\n"
        "    bodyReadTimeoutSeconds: 7.5\n"
        "    maxJsonNodes: 5000\n"
        "    maxJsonDepth: 16\n"
        "    maxUpstreamAnswerBytes: 1048576\n"
        "  modelNamespaces: ['llama-*=platform,ml', 'smollm2=platform']\n"
    )
    settings = settings_seen_by(
        container_of(render(str(values)), GATEWAY), GatewaySettings, gateway_parser,
        "SLOTSERVE_GATEWAY_", monkeypatch,
    )  # fmt: skip
    assert isinstance(settings, GatewaySettings)
    assert settings.memory_budget_bytes == 268_435_456
    assert settings.memory_budget_fraction == 0.25
    assert settings.body_read_timeout_seconds == 7.5
    assert (settings.max_json_nodes, settings.max_json_depth) == (5000, 16)
    assert settings.max_upstream_answer_bytes == 1_048_576
    assert settings.model_namespaces == {"llama-*": ["platform", "ml"], "smollm2": ["platform"]}
