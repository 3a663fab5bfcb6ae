"""Prometheus metrics of one gateway replica (own registry per app: no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.queue_size = Gauge(
            "slotserve_gateway_queue_size",
            "Requests waiting for a slot in the pool (all replicas, as last seen).",
            ["pool"],
            registry=r,
        )
        self.inflight = Gauge(
            "slotserve_gateway_inflight_requests",
            "Slots this replica's requests hold on each endpoint (one per choice, n).",
            ["pool", "endpoint"],
            registry=r,
        )
        self.admitted = Counter(
            "slotserve_gateway_admitted", "Requests given a slot.", ["pool"], registry=r
        )
        self.rejected = Counter(
            "slotserve_gateway_rejected",
            "Requests refused, by reason (queue_full, queue_timeout, backend_unavailable, ...).",
            ["pool", "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "slotserve_gateway_queue_wait_seconds",
            "Time from arrival to slot grant.",
            ["pool"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "slotserve_gateway_upstream_errors",
            "Failed engine calls, by kind (connect, status, stream).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.pool_conflicts = Counter(
            "slotserve_gateway_pool_conflicts",
            "InferencePools ignored because an older pool serves the same model name.",
            ["model"],
            registry=r,
        )
        self.held_bytes = Gauge(
            "slotserve_gateway_held_bytes",
            "Bytes this replica's waiting and streaming requests hold (its memory budget's use).",
            registry=r,
        )
        self.memory_budget = Gauge(
            "slotserve_gateway_memory_budget_bytes",
            "The most bytes this replica's requests may hold; past it 503.",
            registry=r,
        )
        self.backend_up = Gauge(
            "slotserve_gateway_admission_backend_up",
            "1 when the admission backend (Redis or in-process) answers.",
            registry=r,
        )
        # Prefix-aware routing (route_hints.py, pools/routing.py).
        self.prefix_routed = Counter(
            "slotserve_gateway_prefix_routed",
            "Requests with prefix keys given a slot: hit when the engine they went to reported "
            "holding a prefix of them (its /load), else miss.",
            ["pool", "outcome"],
            registry=r,
        )
        self.prefix_keys_matched = Counter(
            "slotserve_gateway_prefix_keys_matched",
            "Prefix keys (chat messages, 512-character blocks) the chosen engines held: the "
            "prefix reused, in keys.",
            ["pool"],
            registry=r,
        )
        self.prefix_index_keys = Gauge(
            "slotserve_gateway_prefix_index_keys",
            "Prefix keys each engine reported holding in its slot rows (its index size).",
            ["pool", "endpoint"],
            registry=r,
        )
        # Tenants (tenant_gate.py): labels come from the keys file, bounded there (tenants.py).
        self.tenant_requests = Counter(
            "slotserve_gateway_tenant_requests",
            "Requests per tenant by outcome: answered, a quota refusal (max_inflight, "
            "requests_per_minute, tokens_per_minute, zero_quota) or the error's code.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "slotserve_gateway_tenant_tokens",
            "Tokens per tenant: estimated (charged at admission), counted (answers' usage).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_queue_wait = Histogram(
            "slotserve_gateway_tenant_queue_wait_seconds",
            "Time from arrival to slot grant, per pool and tenant (its fair share at work).",
            ["pool", "tenant"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=r,
        )
        self.tenant_inflight = Gauge(
            "slotserve_gateway_tenant_inflight_requests",
            "Requests of each limited tenant this replica has in flight (past its quotas).",
            ["tenant"],
            registry=r,
        )
