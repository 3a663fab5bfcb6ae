"""The Grafana dashboard shipped in the chart: off by default, a sidecar-labelled ConfigMap when
on, and every metric its queries name is one the code exports (gateway and engine registries).
"""

from __future__ import annotations

import json
import re

from slotserve.engine.core.stats import EngineStats
from slotserve.engine.http.metrics import EngineMetrics
from slotserve.gateway.http.metrics import GatewayMetrics
from tests.charts.chart_support import NAMESPACE, RELEASE, ROOT
from tests.metric_registry import series_names

DASHBOARD = ROOT / "charts" / "slotserve" / "dashboards" / "slotserve-pools.json"
CONFIGMAP = f"{RELEASE}-slotserve-dashboard"
# A metric name right before its label matcher or range: name{...} or name[...].
METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]")
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "by", "histogram_quantile"}
# What the issue asks the dashboard to show, by the metric that shows it.
REQUIRED = {
    "queue depth": "slotserve_gateway_queue_size",
    "in flight": "slotserve_gateway_inflight_requests",
    "slots": "slotserve_slots_total",
    "admitted": "slotserve_gateway_admitted_total",
    "rejected": "slotserve_gateway_rejected_total",
    "queue wait": "slotserve_gateway_queue_wait_seconds_bucket",
    "TTFT": "vllm:time_to_first_token_seconds_bucket",
    "TPOT": "vllm:inter_token_latency_seconds_bucket",
    "tokens/s": "vllm:generation_tokens_total",
    "KV usage": "vllm:kv_cache_usage_perc",
    "slot utilisation": "slotserve_slot_utilisation",
}


def exported() -> set[str]:
    stats = EngineStats(
        policy="continuous",
        num_running=0,
        num_waiting=0,
        num_slots_total=1,
        num_slots_free=1,
        kv_cache_usage=0.0,
        kv_cache_tokens_total=1,
        slot_utilisation=0.0,
        num_steps=0,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
    )
    engine = EngineMetrics(lambda: "m", lambda: stats, lambda: False)
    return series_names(engine.registry) | series_names(GatewayMetrics().registry)


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_in_the_dashboard_is_exported_by_the_code():
    names = {name for expr in queries() for name in METRIC.findall(expr)} - PROMQL_WORDS
    assert names, "no metric found in the dashboard's queries"
    missing = names - exported()
    assert not missing, f"the dashboard queries metrics no registry exports: {sorted(missing)}"


def test_the_dashboard_shows_what_operators_need():
    text = " ".join(queries())
    for what, metric in REQUIRED.items():
        assert metric in text, f"no panel for {what} ({metric})"
    titles = [panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]]
    assert "Engine replicas" in titles


def test_the_dashboard_is_off_by_default(render):
    assert not render().has("ConfigMap", CONFIGMAP)


def test_the_dashboard_configmap_carries_the_sidecar_label(render):
    rendered = render(
        extra=[
            "--set",
            "grafanaDashboard.enabled=true",
            "--set",
            "grafanaDashboard.annotations.grafana_folder=LLM",
        ]
    )
    configmap = rendered.get("ConfigMap", CONFIGMAP)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["slotserve-pools.json"]) == json.loads(
        DASHBOARD.read_text()
    )


def test_the_dashboard_can_go_to_grafana_s_namespace(render):
    rendered = render(
        extra=["--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.namespace=mon"]
    )
    assert rendered.get("ConfigMap", CONFIGMAP, "mon")["metadata"]["namespace"] == "mon"
