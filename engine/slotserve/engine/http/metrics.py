"""Prometheus metrics of one engine: vLLM's names (what inference gateways scrape) + slotserve's.

Gauges and totals are read from ``AsyncEngine.stats()`` at scrape time, so they are exact and cost
nothing per step; latency histograms are observed by the server when a request finishes. Each app
gets its own ``CollectorRegistry``: several engines in one process (tests) never share counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from slotserve.engine.core.sequence import FailureReason

if TYPE_CHECKING:
    from slotserve.engine.core.stats import EngineStats, RequestMetrics

# Buckets follow vLLM's so dashboards built for it read the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

MODEL_LABEL = "model_name"


class EngineStatsCollector(Collector):
    """Reads one engine snapshot per scrape; yields nothing while the model is still loading."""

    def __init__(
        self,
        model_name: Callable[[], str | None],
        stats: Callable[[], EngineStats | None],
        draining: Callable[[], bool],
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._draining = draining

    def collect(self) -> Iterator[Metric]:
        draining = GaugeMetricFamily(
            "slotserve_draining", "1 while the engine refuses new requests before exiting."
        )
        draining.add_metric([], 1.0 if self._draining() else 0.0)
        yield draining
        stats, name = self._stats(), self._model_name()
        if stats is None or name is None:
            return
        labels = [MODEL_LABEL]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=labels)
            family.add_metric([name], value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=labels)
            family.add_metric([name], value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Requests holding a slot (in the batch).",
            stats.num_running,
        )
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", stats.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of the KV cache in use (0..1).",
            stats.kv_cache_usage,
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(
            "vllm:num_preemptions", "Sequences preempted to free KV cache.", stats.num_preemptions
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission.",
            stats.prefix_cache_queries_total,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV reused, not recomputed).",
            stats.prefix_cache_hits_total,
        )
        yield gauge(
            "slotserve_slots_total", "Sequence slots (max batch size).", stats.num_slots_total
        )
        yield gauge("slotserve_slots_free", "Slots not held by a request.", stats.num_slots_free)
        yield gauge(
            "slotserve_slot_utilisation",
            "Useful token-steps / slot-steps since start (1 = every slot busy every step).",
            stats.slot_utilisation,
        )
        yield gauge(
            "slotserve_kv_cache_tokens_total",
            "KV cache capacity in tokens.",
            stats.kv_cache_tokens_total,
        )
        yield counter("slotserve_engine_steps", "Engine steps run.", stats.num_steps)
        yield counter(
            "slotserve_tenant_preemptions",
            "Sequences preempted for a request of a tenant under its share (not for KV room).",
            stats.num_tenant_preemptions,
        )
        yield counter(
            "slotserve_tenant_recomputed_tokens",
            "Computed tokens that tenant-preempted sequences lost (recomputed on resume).",
            stats.tenant_recomputed_tokens_total,
        )
        failures = CounterMetricFamily(
            "slotserve_sequence_failures",
            "Sequences ended with finish_reason error, by reason (others went on).",
            labels=[MODEL_LABEL, "reason"],
        )
        for reason in get_args(FailureReason):
            failures.add_metric([name, reason], stats.sequence_failures.get(reason, 0))
        yield failures
        yield counter(
            "slotserve_engine_step_failures",
            "Steps whose runner raised: each ends all work and marks the engine broken.",
            stats.num_step_failures,
        )
        calibrations = CounterMetricFamily(
            "slotserve_load_calibrations",
            "Choices made at load, by name and how: measured, or read from the calibration cache.",
            labels=[MODEL_LABEL, "name", "source", "choice"],
        )
        calibration_seconds = GaugeMetricFamily(
            "slotserve_load_calibration_seconds",
            "Seconds each choice made at load cost (measuring, or waiting for and reading it).",
            labels=[MODEL_LABEL, "name", "source", "choice"],
        )
        for record in stats.calibrations:
            record_labels = [name, record.name, record.source, record.choice]
            calibrations.add_metric(record_labels, 1)
            calibration_seconds.add_metric(record_labels, record.seconds)
        yield calibrations
        yield calibration_seconds
        info = InfoMetricFamily(
            "slotserve_policy", "Batching policy of this engine.", labels=labels
        )
        info.add_metric([name], {"policy": stats.policy})
        yield info


class EngineMetrics:
    """The metrics of one engine app; ``render()`` gives the Prometheus text."""

    def __init__(
        self,
        model_name: Callable[[], str | None],
        stats: Callable[[], EngineStats | None],
        draining: Callable[[], bool],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(model_name, stats, draining))
        self._model_name = model_name
        # Recent mean seconds a request held its slot (EWMA, 0 before the first): the speed
        # that gateways use for Retry-After before they have measured any themselves (/load).
        self.mean_request_seconds = 0.0
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            [MODEL_LABEL],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            [MODEL_LABEL],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            [MODEL_LABEL],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before it got a slot.",
            [MODEL_LABEL],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            [MODEL_LABEL, "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "slotserve_requests_rejected",
            "Requests refused before reaching the engine, by reason.",
            ["reason"],
            registry=self.registry,
        )

    def observe_finished(self, finish_reason: str, metrics: RequestMetrics | None) -> None:
        """Record one finished request (aborted ones included)."""
        name = self._model_name() or ""
        self.success.labels(name, finish_reason).inc()
        if metrics is None:
            return
        held_s = max(0.0, metrics.e2e_latency - metrics.queue_time)
        mean = self.mean_request_seconds
        self.mean_request_seconds = held_s if mean == 0 else mean + 0.1 * (held_s - mean)
        self.ttft.labels(name).observe(metrics.time_to_first_token)
        itl = self.itl.labels(name)
        for latency in metrics.inter_token_latencies:
            itl.observe(latency)
        self.e2e.labels(name).observe(metrics.e2e_latency)
        self.queue_time.labels(name).observe(metrics.queue_time)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
