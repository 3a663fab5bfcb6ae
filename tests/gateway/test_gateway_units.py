"""Pure parts of the gateway: routing rules, pool parsing, Kubernetes discovery mapping, CLI."""

from __future__ import annotations

import subprocess

import pytest

from slotserve.gateway.admission.front import DrainRate
from slotserve.gateway.http.proxy import SseEnding, last_event_end
from slotserve.gateway.pools.config import PoolConfigError, parse_pools
from slotserve.gateway.pools.discovery import InvalidPoolObjectError, pool_from_inference_pool
from slotserve.gateway.pools.routing import (
    EndpointOffer,
    load_score,
    rank_endpoints,
)
from slotserve.gateway.settings import GatewaySettings
from tests.gateway.gateway_support import SLOTSERVE


def test_rank_prefers_free_share_then_engine_load_then_url():
    offers = [
        EndpointOffer("http://c", 4, 0.5),
        EndpointOffer("http://b", 4, 0.1),
        EndpointOffer("http://a", 2, 0.9),
        EndpointOffer("http://full", 1, 0.0),
    ]
    inflight = {"http://c": 1, "http://b": 1, "http://full": 1}
    assert [o.url for o in rank_endpoints(offers, inflight)] == ["http://a", "http://b", "http://c"]
    assert [o.url for o in rank_endpoints(offers, inflight, need=3)] == ["http://b", "http://c"]
    assert (
        rank_endpoints(offers, {"http://c": 4, "http://b": 4, "http://a": 2, "http://full": 1})
        == []
    )


def test_load_score_counts_waiting_double():
    assert load_score(running=2, waiting=0, kv_cache_usage=0.0, slots_total=4) < load_score(
        running=1, waiting=1, kv_cache_usage=0.0, slots_total=4
    )


def test_drain_rate_estimates_dispatches_per_second():
    rate = DrainRate(half_life_s=0.5)
    for second in range(20):
        rate.observe(float(second), second * 40)
    assert 35 < rate.rate_per_s <= 40


def test_pool_file_parsing_and_errors():
    pools = parse_pools(
        """
pools:
  - model: smollm2
    endpoints: ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]
    batching:
      {policy: dynamic, maxBatchSize: 8, maxQueueDelayMicroseconds: 500, preferredBatchSizes: [4]}
    admission: {maxQueueSize: 16, queueTimeoutSeconds: 5}
"""
    )
    policy = pools[0].policy
    assert pools[0].endpoints == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert (policy.max_queue_size, policy.queue_timeout_s) == (16, 5)
    # Batching belongs to the engines (their flags); the gateway keeps only admission limits.
    assert (pools[0].batching.policy, pools[0].batching.max_queue_delay_microseconds) == (
        "dynamic",
        500,
    )
    bad = {
        "pools: [": "not valid YAML",
        "pools: [{model: m, admission: {maxQueSize: 3}}]": "maxQueSize",
        "pools: [{model: m, endpoints: ['ftp://x']}]": "http(s)://",
        "pools: [{model: m}, {model: m}]": "same model",
        "pools: [{model: m, admission: {maxQueueSize: -1}}]": "maxQueueSize",
    }
    for text, needle in bad.items():
        with pytest.raises(PoolConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            parse_pools(text)


def inference_pool(name="p", model="smollm2", endpoints=("10.0.0.2:8000", "10.0.0.1:8000")):
    return {
        "apiVersion": "slotserve.dev/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "model": {"name": model, "source": {"hub": {"id": "x"}}},
            "replicas": 2,
            "batching": {"policy": "continuous", "maxBatchSize": 16},
            "admission": {"maxQueueSize": 64, "queueTimeoutSeconds": 10},
        },
        "status": {"endpoints": list(endpoints), "readyReplicas": 2},
    }


def test_inference_pool_becomes_a_pool():
    pool = pool_from_inference_pool(inference_pool())
    assert pool.model == "smollm2"
    # status.endpoints is information only: endpoints come from the Service's EndpointSlices.
    assert pool.endpoints == ()
    assert pool.batching.max_batch_size == 16
    assert pool.admission.max_queue_size == 64
    with pytest.raises(InvalidPoolObjectError, match=r"spec\.model\.name"):
        pool_from_inference_pool({"spec": {}})
    broken = inference_pool()
    broken["spec"]["admission"]["maxQueueSize"] = "lots"
    with pytest.raises(InvalidPoolObjectError, match="admission"):
        pool_from_inference_pool(broken)


def test_settings_namespaces_comma_list(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_GATEWAY_NAMESPACES", "ml, prod ,")
    monkeypatch.setenv("SLOTSERVE_GATEWAY_LEASE_TTL_SECONDS", "3")
    settings = GatewaySettings()
    assert settings.namespaces == ["ml", "prod"]
    assert settings.lease_ttl_seconds == 3


def run_gateway_cli(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [str(SLOTSERVE), "gateway", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_cli_reports_bad_configuration(tmp_path):
    run = run_gateway_cli()
    assert run.returncode == 2 and "--config is required" in run.stderr
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools: [{model: m, endpoints: [nope]}]")
    run = run_gateway_cli("--config", str(bad), "--port", "0")
    assert run.returncode == 2 and "http(s)://" in run.stderr
    run = run_gateway_cli("--config", str(bad), "--lease-ttl-seconds", "-1")
    assert run.returncode == 2 and "lease_ttl_seconds" in run.stderr


def stream_ending(*chunks: bytes) -> tuple[bool, bool]:
    ending = SseEnding()
    for chunk in chunks:
        ending.feed(chunk[: last_event_end(chunk)])
    return ending.done, ending.errored


def test_stream_ending_is_told_from_the_last_whole_event():
    chunk = b'data: {"choices": []}\n\n'
    assert stream_ending(chunk, b"data: [DONE]\n\n") == (True, False)
    assert stream_ending(chunk.replace(b"\n", b"\r\n"), b"data:[DONE]\r\n\r\n") == (True, False)
    long_error = b'data: {"error": {"message": "' + b"x" * 5000 + b'"}}\n\n'
    assert stream_ending(chunk, long_error) == (False, True)
    # Cut short: a half event is not whole, so the stream counts as neither done nor errored.
    assert stream_ending(chunk, b"data: [DO") == (False, False)
    assert stream_ending(b'data: {"error": "x"}\n\ndata: {"choices": []}\n\n') == (False, False)
    assert last_event_end(b"data: a\n\ndata: b") == len(b"data: a\n\n")
    assert last_event_end(b"data: a") == 0
