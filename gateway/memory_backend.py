"""In-process admission backend: the same semantics as the Redis backend, for one process.

It is the embedded default (no ``--redis-url``). Several ``InProcessBackend`` objects may share
one ``InProcessHub`` to stand for several replicas, which is how the shared admission test suite
exercises leases of dead replicas without Redis. Everything runs on one event loop and no method
awaits in the middle, so every step is atomic just like a Lua script.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from slotserve.gateway.admission_types import (
    CancelOutcome,
    DispatchResult,
    Grant,
    GrantCallback,
    PoolPolicy,
    QueueFullError,
)
from slotserve.gateway.routing import EndpointOffer, group_size, rank_endpoints

PRIORITY_STRIDE = 10**13  # queue score = priority * stride + arrival sequence (as in Redis)


def _monotonic_us() -> int:
    return int(time.monotonic() * 1_000_000)


@dataclass
class _Entry:
    replica: str
    deadline_us: int
    enqueued_us: int


@dataclass
class _PoolState:
    queue: dict[str, int] = field(default_factory=dict)  # request id -> score
    entries: dict[str, _Entry] = field(default_factory=dict)
    seq: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expiry (us)
    lease_endpoint: dict[str, str] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    num_dispatched: int = 0

    def head(self, now_us: int) -> tuple[str, _Entry] | None:
        while self.queue:
            request_id = min(self.queue, key=self.queue.__getitem__)
            entry = self.entries.get(request_id)
            if entry is not None and entry.deadline_us > now_us:
                return request_id, entry
            self._drop(request_id)
        return None

    def _drop(self, request_id: str) -> None:
        self.queue.pop(request_id, None)
        self.entries.pop(request_id, None)

    def free_lease(self, request_id: str) -> bool:
        if self.leases.pop(request_id, None) is None:
            return False
        endpoint = self.lease_endpoint.pop(request_id, "")
        self.inflight[endpoint] = self.inflight.get(endpoint, 0) - 1
        if self.inflight[endpoint] <= 0:
            del self.inflight[endpoint]
        return True


class InProcessHub:
    """The shared state: what Redis holds for the Redis backend."""

    def __init__(
        self, lease_ttl_s: float = 10.0, clock_us: Callable[[], int] = _monotonic_us
    ) -> None:
        self.lease_ttl_us = int(lease_ttl_s * 1_000_000)
        self.clock_us = clock_us
        self.pools: dict[str, _PoolState] = {}
        self.alive_until: dict[str, int] = {}
        self.listeners: dict[str, GrantCallback] = {}

    def pool(self, name: str) -> _PoolState:
        return self.pools.setdefault(name, _PoolState())

    def dispatch(
        self, policy: PoolPolicy, offers: Sequence[EndpointOffer], caller: str, now_us: int
    ) -> DispatchResult:
        state = self.pool(policy.name)
        mine: list[Grant] = []
        hold_us = 0

        def grant(request_id: str, entry: _Entry, endpoint: str) -> None:
            state._drop(request_id)
            state.leases[request_id] = now_us + self.lease_ttl_us
            state.lease_endpoint[request_id] = endpoint
            state.inflight[endpoint] = state.inflight.get(endpoint, 0) + 1
            state.num_dispatched += 1
            if entry.replica == caller:
                mine.append(Grant(request_id, endpoint))
            elif entry.replica in self.listeners:
                self.listeners[entry.replica](policy.name, request_id, endpoint)

        idle_only = policy.policy != "continuous"
        while (head := state.head(now_us)) is not None:
            request_id, entry = head
            ranked = rank_endpoints(offers, state.inflight, idle_only=idle_only)
            if not ranked:
                break
            if not idle_only:
                grant(request_id, entry, ranked[0].url)
                continue
            waited_us = now_us - entry.enqueued_us
            size = group_size(
                num_waiting=len(state.queue),
                slots_total=ranked[0].slots_total,
                preferred_batch_sizes=policy.preferred_batch_sizes,
                waited_us=waited_us,
                max_queue_delay_us=policy.max_queue_delay_us,
            )
            if size == 0:
                hold_us = max(1, policy.max_queue_delay_us - waited_us)
                break
            grant(request_id, entry, ranked[0].url)
            for _ in range(size - 1):
                nxt = state.head(now_us)
                if nxt is None:
                    break
                grant(nxt[0], nxt[1], ranked[0].url)
        return DispatchResult(mine, len(state.queue), state.num_dispatched, hold_us)


class InProcessBackend:
    """One replica's view of an ``InProcessHub``."""

    def __init__(self, hub: InProcessHub, replica_id: str) -> None:
        self.hub = hub
        self.replica_id = replica_id

    async def start(self, on_grant: GrantCallback) -> None:
        self.hub.listeners[self.replica_id] = on_grant
        self.hub.alive_until[self.replica_id] = self.hub.clock_us() + self.hub.lease_ttl_us

    async def close(self) -> None:
        self.hub.listeners.pop(self.replica_id, None)

    async def enqueue(
        self,
        pool: PoolPolicy,
        offers: Sequence[EndpointOffer],
        request_id: str,
        priority: int,
        timeout_us: int,
        *,
        only_if_absent: bool = False,
    ) -> DispatchResult:
        now = self.hub.clock_us()
        state = self.hub.pool(pool.name)
        if only_if_absent and (request_id in state.queue or request_id in state.leases):
            return DispatchResult([], len(state.queue), state.num_dispatched, 0)
        state.seq += 1
        state.queue[request_id] = priority * PRIORITY_STRIDE + state.seq
        state.entries[request_id] = _Entry(self.replica_id, now + timeout_us, now)
        result = self.hub.dispatch(pool, offers, self.replica_id, now)
        if request_id in state.queue and len(state.queue) > pool.max_queue_size:
            state._drop(request_id)
            raise QueueFullError(
                f"queue of pool {pool.name!r} is full ({pool.max_queue_size} waiting)",
                queue_depth=len(state.queue),
                num_dispatched_total=state.num_dispatched,
            )
        return result

    async def release(
        self, pool: PoolPolicy, offers: Sequence[EndpointOffer], request_id: str
    ) -> DispatchResult:
        self.hub.pool(pool.name).free_lease(request_id)
        return self.hub.dispatch(pool, offers, self.replica_id, self.hub.clock_us())

    async def cancel(self, pool: PoolPolicy, request_id: str) -> CancelOutcome:
        state = self.hub.pool(pool.name)
        if request_id in state.queue:
            state._drop(request_id)
            return CancelOutcome("cancelled")
        if request_id in state.leases:
            return CancelOutcome("granted", state.lease_endpoint[request_id])
        return CancelOutcome("gone")

    async def tick(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> DispatchResult:
        now = self.hub.clock_us()
        state = self.hub.pool(pool.name)
        for request_id, expiry in list(state.leases.items()):
            if expiry <= now:
                state.free_lease(request_id)
        for request_id, entry in list(state.entries.items()):
            if self.hub.alive_until.get(entry.replica, 0) <= now or entry.deadline_us <= now:
                state._drop(request_id)
        return self.hub.dispatch(pool, offers, self.replica_id, now)

    async def heartbeat(self, leases: dict[str, list[tuple[str, str]]], *, restore: bool) -> bool:
        now = self.hub.clock_us()
        was_alive = self.hub.alive_until.get(self.replica_id, 0) > now
        self.hub.alive_until[self.replica_id] = now + self.hub.lease_ttl_us
        for pool_name, held in leases.items():
            state = self.hub.pool(pool_name)
            for request_id, endpoint in held:
                if request_id in state.leases:
                    state.leases[request_id] = now + self.hub.lease_ttl_us
                elif restore:
                    state.leases[request_id] = now + self.hub.lease_ttl_us
                    state.lease_endpoint[request_id] = endpoint
                    state.inflight[endpoint] = state.inflight.get(endpoint, 0) + 1
        return was_alive

    async def inflight(self, pool: PoolPolicy) -> dict[str, int]:
        return dict(self.hub.pool(pool.name).inflight)
