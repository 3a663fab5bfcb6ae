"""The same admission steps on a real Redis and on the in-process hub, side by side.

The in-process backend is the oracle: every step runs on both, and ``Twin`` compares what each
answered, which grants each delivered, and the whole state after it. Both read one clock that
the test moves (``advance``): the scripts are the real ones with only their clock swapped for a
Redis key (``now_us`` reads ``P:fuzz-now`` instead of ``TIME``), so deadlines, lease expiry,
demotion and promises fall due at the same instant on both sides.

Replicas are ``RedisBackend``/``InProcessBackend`` pairs that never start their loops: no
heartbeat task, no grant listener. Their liveness is a key without a TTL (killed: deleted),
and other replicas' grant lists are read after every step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import redis

from slotserve.contracts.pool_spec import MAX_PRIORITY_LEVELS
from slotserve.contracts.redis_keys import Keys
from slotserve.gateway.admission.backends.memory import InProcessBackend, InProcessHub
from slotserve.gateway.admission.backends.redis import RedisBackend
from slotserve.gateway.admission.lua.scripts import SCRIPTS
from slotserve.gateway.admission.preempt_share import max_outstanding, split_grant
from slotserve.gateway.admission.types import REFUSED, AdmissionError, PoolPolicy
from slotserve.gateway.pools.routing import ROUTED_TTL_MS, SESSION_TTL_MS, EndpointOffer

REAL_CLOCK = """local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end"""
FAKE_CLOCK = """local function now_us()
  return tonumber(redis.call('GET', PREFIX .. ':fuzz-now'))
end"""
START_US = 1_800_000_000_000_000
EPOCH = "fuzz-epoch"
FOREVER_US = 1 << 62


def fake_clock_scripts() -> dict[str, str]:
    scripts = {}
    for name, source in SCRIPTS.items():
        assert REAL_CLOCK in source, f"{name}: the clock to swap is not where the twin expects it"
        scripts[name] = source.replace(REAL_CLOCK, FAKE_CLOCK)
    return scripts


@dataclass
class Outcome:
    """What one step answered, in terms both backends share."""

    kind: str  # ok, cancel:<state>, or the error's class name
    detail: tuple[object, ...] = ()


@dataclass
class Side:
    """One backend's replicas and what they were delivered."""

    name: str
    delivered: dict[str, str] = field(default_factory=dict)  # request id -> endpoint/REFUSED
    replica_of: dict[str, str] = field(default_factory=dict)  # request id -> its replica
    step_deliveries: list[tuple[str, str, str]] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)  # request ids delivered more than once

    def on_grant(self, replica: str) -> object:
        def deliver(pool: str, request_id: str, endpoint: str) -> None:
            if request_id in self.delivered:
                self.twice.append(request_id)
            self.delivered[request_id] = endpoint
            self.replica_of[request_id] = replica
            self.step_deliveries.append((replica, request_id, endpoint))

        return deliver


class Twin:
    def __init__(
        self,
        url: str,
        prefix: str,
        num_replicas: int,
        lease_ttl_s: float,
        routed_ttl_ms: int | None = None,
    ) -> None:
        # Redis expires routed keys on its own clock, the scripts and the hub read the fake one:
        # a run longer in real time than the keys' TTL would see Redis drop keys the hub still
        # holds. ``routed_ttl_ms`` replaces the TTL on the Redis side (the test sets the hub's).
        self.routed_ttl_ms = routed_ttl_ms
        self.url = url
        self.keys = Keys(prefix)
        self.prefix = prefix
        self.sync = redis.Redis.from_url(url, decode_responses=True)
        self.now_us = START_US
        self.hub = InProcessHub(lease_ttl_s, clock_us=lambda: self.now_us)
        self.names = [f"replica-{i}|x" for i in range(num_replicas)]  # '|' in a name is allowed
        self.redis_side, self.memory_side = Side("redis"), Side("memory")
        self.redis: list[RedisBackend] = []
        self.memory: list[InProcessBackend] = []
        self.lease_ttl_s = lease_ttl_s

    async def start(self) -> None:
        self.sync.flushall()
        self.sync.set(f"{self.prefix}:fuzz-now", self.now_us)
        self.sync.hset(self.keys.epoch(), mapping={"id": EPOCH, "created": 0, "ready": 0})
        scripts = fake_clock_scripts()
        if self.routed_ttl_ms is not None:
            ttls = f"local ROUTED_TTL_MS, SESSION_TTL_MS = {ROUTED_TTL_MS}, {SESSION_TTL_MS}"
            longer = f"local ROUTED_TTL_MS, SESSION_TTL_MS = {self.routed_ttl_ms}, {SESSION_TTL_MS}"
            assert all(ttls in source for source in scripts.values() if "ROUTED_TTL_MS" in source)
            scripts = {key: source.replace(ttls, longer) for key, source in scripts.items()}
        for name in self.names:
            backend = RedisBackend(self.url, name, prefix=self.prefix, lease_ttl_s=self.lease_ttl_s)
            backend.scripts = {
                key: backend.client.register_script(source) for key, source in scripts.items()
            }
            backend.epoch = EPOCH
            backend._on_grant = self.redis_side.on_grant(name)  # type: ignore[assignment]
            self.redis.append(backend)
            self.sync.set(self.keys.replica(name), "1")
            memory = InProcessBackend(self.hub, name)
            await memory.start(self.memory_side.on_grant(name))  # type: ignore[arg-type]
            self.hub.alive_until[name] = FOREVER_US
            self.memory.append(memory)

    async def close(self) -> None:
        for backend in self.redis:
            for client in (backend.client, backend.blocking_client, backend.control_client):
                await client.aclose()
        self.sync.close()

    # -- time and liveness, on both sides ---------------------------------------------------

    def advance(self, micros: int) -> None:
        self.now_us += micros
        self.sync.set(f"{self.prefix}:fuzz-now", self.now_us)

    def kill(self, replica: int) -> None:
        self.sync.delete(self.keys.replica(self.names[replica]))
        self.hub.alive_until[self.names[replica]] = 0

    # -- one step on both ---------------------------------------------------------------------

    async def run(self, replica: int, method: str, *args: object, **kwargs: object) -> None:
        """The same backend call on both sides; fails the test unless both answered alike and
        delivered the same grants."""
        self.redis_side.step_deliveries.clear()
        self.memory_side.step_deliveries.clear()
        outcomes = []
        for backends in (self.redis, self.memory):
            backend = backends[replica]
            try:
                result = await getattr(backend, method)(*args, **kwargs)
            except AdmissionError as exc:
                detail: tuple[object, ...] = (exc.status, exc.retry_after_s)
                outcomes.append(Outcome(type(exc).__name__, detail))
                if backends is self.redis:  # a refusal's step may still have granted others
                    self.read_grant_lists()
                continue
            if method == "cancel":
                outcomes.append(Outcome(f"cancel:{result.state}", (result.endpoint,)))
            elif method == "heartbeat":
                outcomes.append(Outcome("ok"))
            else:
                outcomes.append(Outcome("ok", (result.queue_depth, result.num_dispatched_total)))
            if backends is self.redis:
                self.read_grant_lists()
        assert outcomes[0] == outcomes[1], f"{method}: redis {outcomes[0]} != memory {outcomes[1]}"
        assert outcomes[0].kind != "BackendUnavailableError"
        redis_got = sorted(self.redis_side.step_deliveries)
        memory_got = sorted(self.memory_side.step_deliveries)
        assert redis_got == memory_got, f"{method}: deliveries {redis_got} != {memory_got}"

    def read_grant_lists(self) -> None:
        """Grants made for replicas other than the caller (their listeners are not running)."""
        pipe = self.sync.pipeline(transaction=True)
        for name in self.names:
            pipe.lrange(self.keys.grants(name), 0, -1)
            pipe.delete(self.keys.grants(name))
        replies = pipe.execute()
        for name, items in zip(self.names, replies[::2], strict=True):
            for item in items:
                pool, request_id, endpoint = str(item).split("\x1f")
                self.redis_side.on_grant(name)(pool, request_id, endpoint)  # type: ignore[operator]

    # -- state ------------------------------------------------------------------------------

    def redis_state(self, pool: PoolPolicy) -> dict[str, object]:
        """Every admission key of ``pool``, read in one round trip (the fuzz reads it twice a
        step: one command a key made it ~70 round trips a step, most of the test's time)."""

        def key(name: str) -> str:
            return self.keys.pool_key(pool.name, name)

        pipe = self.sync.pipeline(transaction=True)
        hashes = ["entries", "stats", "lease_slots", "lease_endpoint", "levels", "inflight"]
        hashes += ["lease_tenants", "tenant_held", "tenant_held_at", "entry_tenants", "route_waits"]
        for name in hashes:
            pipe.hgetall(key(name))
        for name in ("queue", "leases", "delays"):
            pipe.zrange(key(name), 0, -1)
        pipe.zrange(key("retries"), 0, -1, withscores=True)
        pipe.zcard(key("deadlines"))
        for name in self.names:
            pipe.zrange(self.keys.waiting(pool.name, name), 0, -1)
        levels = range(MAX_PRIORITY_LEVELS + 1)
        for level in levels:
            pipe.hgetall(self.keys.fair(pool.name, level))
            pipe.zrange(self.keys.fair_queue(pool.name, level), 0, -1, withscores=True)
        replies = iter(pipe.execute())
        h: dict[str, dict[str, str]] = {name: next(replies) for name in hashes}
        queue, lease_ids, delays, retries, deadlines = (next(replies) for _ in range(5))
        waiting = [next(replies) for _ in self.names]
        fair: dict[int, tuple[dict[str, int], list]] = {}
        for level in levels:
            fields, tags = next(replies), next(replies)
            if fields or tags:
                values = {str(name): int(value) for name, value in fields.items()}
                fair[level] = (values, [(rid, int(tag)) for rid, tag in tags])
        stats, lease_slots, entries = h["stats"], h["lease_slots"], h["entries"]
        return {
            "queue": queue,
            "entries": {
                rid: (fields[0], int(fields[3]), int(fields[4]))
                for rid, fields in ((rid, info.rsplit("|", 4)) for rid, info in entries.items())
            },
            "levels": {int(k): int(v) for k, v in h["levels"].items()},
            "leases": {
                rid: (h["lease_endpoint"].get(rid), int(lease_slots.get(rid, 1)))
                for rid in lease_ids
            },
            "inflight": {k: int(v) for k, v in h["inflight"].items()},
            "dispatched": int(stats.get("dispatched", 0)),
            "held": int(stats.get("held", 0)),
            "promised": [int(due) for _, due in retries],
            "horizon": int(stats.get("retry_horizon", 0)),
            "settled": int(stats.get("settled", 0)),
            "kept": (int(stats.get("kept", 0)), int(stats.get("lapsed", 0))),
            "demoting": set(delays),
            "fair": fair,
            "lease_tenants": h["lease_tenants"],
            "tenant_held": {k: int(v) for k, v in h["tenant_held"].items()},
            "tenant_held_at": {
                tuple(str(k).split("\x1f")): int(v) for k, v in h["tenant_held_at"].items()
            },
            "entry_tenants": h["entry_tenants"],
            "preempting": int(stats.get("preempting", 0)),
            "route_waits": {k: int(v) for k, v in h["route_waits"].items()},
            # Not compared with the oracle (``check`` pops them): the invariants' own reads.
            "deadlines": deadlines,
            "waiting": set().union(*waiting),
        }

    def memory_state(self, pool: PoolPolicy) -> dict[str, object]:
        state = self.hub.pool(pool.name)
        live = sorted({item for item in state.queue_heap if state.queue.get(item[1]) == item[0]})
        return {
            "queue": [request_id for _, request_id in live],
            "entries": {rid: (e.replica, e.level, e.slots) for rid, e in state.entries.items()},
            "levels": dict(state.level_counts),
            "leases": {
                rid: (state.lease_endpoint[rid], state.lease_slots.get(rid, 1))
                for rid in state.leases
            },
            "inflight": dict(state.inflight),
            "dispatched": state.num_dispatched,
            "held": state.num_held,
            "promised": list(state.promised),
            "horizon": state.retry_horizon_us,
            "settled": state.settled_us,
            "kept": (state.num_kept, state.num_lapsed),
            "demoting": set(state.delays),
            "fair": {
                level: (dict(fair.fields), sorted(fair.tags.items(), key=lambda i: (i[1], i[0])))
                for level, fair in state.fair.items()
                if fair.fields or fair.tags
            },
            "lease_tenants": dict(state.lease_tenant),
            "tenant_held": dict(state.tenant_held),
            "tenant_held_at": dict(state.tenant_held_at),
            "entry_tenants": {
                rid: e.tenant for rid, e in state.entries.items() if e.tenant is not None
            },
            "preempting": state.num_preempting,
            "route_waits": (
                {"=room": state.room_idle_since_us} if state.room_idle_since_us is not None else {}
            ),
        }

    def check(self, pool: PoolPolicy, offers: list[EndpointOffer], before: dict[str, int]) -> None:
        """The invariants on Redis, then Redis equal to the oracle."""
        got = self.redis_state(pool)
        deadlines, waiting = got.pop("deadlines"), got.pop("waiting")
        entries = got["entries"]
        assert isinstance(entries, dict)
        # Counts equal to the entries.
        queue = got["queue"]
        assert isinstance(queue, list)
        assert set(queue) == set(entries), "queue and entries differ"
        assert deadlines == len(entries)
        levels = Counter(level for _, level, _ in entries.values())
        assert got["levels"] == dict(levels), f"level counts {got['levels']} != {dict(levels)}"
        assert waiting == set(entries), "the replicas' waiting sets differ from the entries"
        assert got["demoting"] <= set(queue)  # type: ignore[operator]
        # Every entry has its start tag at its level, and only entries have one.
        fair = got["fair"]
        assert isinstance(fair, dict)
        tagged = {(level, rid) for level, (_, tags) in fair.items() for rid, _ in tags}
        assert tagged == {(level, rid) for rid, (_, level, _) in entries.items()}, "fair tags"
        # No engine over its slots: a step never grows an endpoint past its slots, and the
        # in-flight count is the sum of the leases' weights.
        leases = got["leases"]
        assert isinstance(leases, dict)
        weights: Counter[str] = Counter()
        for endpoint, slots in leases.values():
            weights[endpoint] += slots
        assert got["inflight"] == dict(weights), "in-flight differs from the leases"
        # Preempting grants (``preempt_share.py``) may take an engine over its slots, by at most
        # ``max_outstanding(slots)`` (half its slots, at least one) and only from its slots.
        slots_of = {offer.url: offer.slots_total for offer in offers}
        inflight = got["inflight"]
        assert isinstance(inflight, dict)
        for endpoint, used in inflight.items():
            if used > before.get(endpoint, 0):
                slots = slots_of.get(endpoint, 0)
                extra = max_outstanding(slots) if pool.preempt_for_share and slots else 0
                assert used <= slots + extra, f"{endpoint} over its slots: {used}"
        # The tenants' held slots are the sum of their leases' (a lease restored without a
        # tenant counts for nobody).
        lease_tenants = got["lease_tenants"]
        assert isinstance(lease_tenants, dict)
        held: Counter[str] = Counter()
        held_at: Counter[tuple[str, str]] = Counter()
        for rid, tenant in lease_tenants.items():
            endpoint, slots = leases[rid]
            held[tenant] += slots
            held_at[(tenant, endpoint)] += slots
        assert got["tenant_held"] == dict(held), "held slots per tenant differ from the leases"
        assert got["tenant_held_at"] == dict(held_at), "held slots per engine differ"
        # Every grant delivered or released: each lease was delivered to its replica, once.
        for rid, (endpoint, _) in leases.items():
            url, _ = split_grant(self.redis_side.delivered.get(rid) or "")
            assert url == endpoint, f"lease {rid} never delivered"
        assert not self.redis_side.twice and not self.memory_side.twice
        assert REFUSED not in {endpoint for endpoint, _ in leases.values()}
        # The oracle.
        expected = self.memory_state(pool)
        for name, value in got.items():
            assert value == expected[name], f"{name}: redis {value} != memory {expected[name]}"
