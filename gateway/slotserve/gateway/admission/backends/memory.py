"""In-process admission backend: the same semantics as the Redis backend, for one process.

It is the embedded default (no ``--redis-url``). Several ``InProcessBackend`` objects may share
one ``InProcessHub`` to stand for several replicas, which is how the shared admission test suite
exercises leases of dead replicas without Redis. Everything runs on one event loop and no method
awaits in the middle, so every step is atomic just like a Lua script.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from slotserve.gateway.admission.backends.memory_pool import Entry, PoolState, StepBudget
from slotserve.gateway.admission.backends.memory_steps import (
    cache_waits,
    preemption_for,
    preemptor_behind,
)
from slotserve.gateway.admission.preempt_share import (
    PREEMPT_MARK,
)
from slotserve.gateway.admission.tenants import DEFAULT_TENANT
from slotserve.gateway.admission.types import (
    DEFAULT_AGING_US,
    MAX_LEASE_SLOTS,
    REFUSED,
    CancelOutcome,
    DeadlineUnreachableError,
    DispatchResult,
    GrantCallback,
    NoEngineFitsError,
    PoolPolicy,
    QueueFullError,
    check_enqueue,
    predicted_wait_us,
    promise_horizon_us,
)
from slotserve.gateway.pools.routing import (
    EndpointOffer,
    Route,
    most_slots,
    pick_endpoint,
    rank_endpoints,
    sendable_route,
    sound_offers,
)


def _monotonic_us() -> int:
    return int(time.monotonic() * 1_000_000)


class InProcessHub:
    """The shared state: what Redis holds for the Redis backend."""

    def __init__(
        self, lease_ttl_s: float = 10.0, clock_us: Callable[[], int] = _monotonic_us
    ) -> None:
        self.lease_ttl_us = int(lease_ttl_s * 1_000_000)
        self.clock_us = clock_us
        self.pools: dict[str, PoolState] = {}
        self.alive_until: dict[str, int] = {}
        self.listeners: dict[str, GrantCallback] = {}

    def pool(self, name: str) -> PoolState:
        state = self.pools.get(name)
        if state is None:
            state = self.pools[name] = PoolState()
        return state

    def is_alive(self, replica: str, now_us: int) -> bool:
        return self.alive_until.get(replica, 0) > now_us

    def dispatch(
        self, policy: PoolPolicy, offers: Sequence[EndpointOffer], caller: str, now_us: int
    ) -> DispatchResult:
        state = self.pool(policy.name)
        state.settle_promises(now_us, policy.max_queue_size)
        offers = sound_offers(offers)
        most = most_slots(offers)
        budget = StepBudget()

        def alive(replica: str) -> bool:
            return replica == caller or self.is_alive(replica, now_us)

        # Every policy alike: the engine forms its batches (static, dynamic) from what arrives.
        while (head := state.head(now_us, alive, budget)) is not None:
            request_id, entry, tag = head
            if offers and entry.slots > most:
                # No ready engine can ever hold it: refused, so it never blocks the queue.
                if budget.num_refusals == 0:
                    break
                budget.num_refusals -= 1
                state._drop(request_id)
                state.num_refused += 1
                self.deliver(policy.name, entry.replica, request_id, REFUSED)
                continue
            # The head waits for all its slots, and those behind it wait for the head (FIFO); a
            # head that waits for the engine holding its prefix lets one behind it pass.
            ranked = rank_endpoints(offers, state.inflight, need=entry.slots)
            if ranked and cache_waits(state, offers, ranked, entry, entry.slots, now_us):
                assert entry.route is not None
                if not self.pass_head(
                    policy, state, offers, entry.level, request_id, entry.route, alive, now_us
                ):
                    # Room goes unused while they wait: from now on it counts against the wait.
                    if state.room_idle_since_us is None:
                        state.room_idle_since_us = now_us
                    break
                continue
            preemption = None
            if not ranked and policy.preempt_for_share and entry.slots == 1 and entry.tenant:
                # No free slot: a tenant under its share may take one (``preempt_share.py``).
                fair = state.fair.get(entry.level)
                fields = fair.fields if fair is not None else {}
                preemption = preemption_for(state, offers, entry.tenant, fields)
            if not ranked and preemption is None and policy.preempt_for_share:
                # The head may not preempt: one behind it may (``preempt_share.py``).
                behind = preemptor_behind(state, offers, entry, now_us, alive)
                if behind is not None:
                    request_id, entry, tag, preemption = behind
            if not ranked and preemption is None:
                state.room_idle_since_us = None  # no room left: nothing goes unused
                break
            if preemption is not None:
                url, victim = preemption.offer.url, preemption.victim
            else:
                url, victim = self.routed_url(state, ranked, entry.route, now_us), None
            self.grant_entry(policy, state, request_id, entry, tag, url, now_us, victim)
        else:
            state.room_idle_since_us = None  # nobody left to dispatch waits
        state.hold_freed_places(policy.max_queue_size)
        return DispatchResult(len(state.queue), state.num_dispatched, 0)

    def pass_head(
        self,
        policy: PoolPolicy,
        state: PoolState,
        offers: Sequence[EndpointOffer],
        level: int,
        head_id: str,
        route: Route,
        alive: Callable[[str], bool],
        now_us: int,
    ) -> bool:
        """Grants the first of the ``route.look_ahead`` entries behind a waiting head, in its
        level's fair order, that an engine with room takes now (``lua/cache_wait.py``)."""
        window = [
            item for item in state.fair_window(level, route.look_ahead + 1) if item[0] != head_id
        ][: route.look_ahead]
        most = most_slots(offers)
        for request_id, tag in window:
            entry = state.entries.get(request_id)
            due = state.delays.get(request_id, now_us + 1) <= now_us
            if (
                entry is None
                or entry.deadline_us <= now_us
                or not alive(entry.replica)
                or due
                or entry.slots > most
            ):
                continue
            ranked = rank_endpoints(offers, state.inflight, need=entry.slots)
            if not ranked or cache_waits(state, offers, ranked, entry, entry.slots, now_us):
                continue
            url = self.routed_url(state, ranked, entry.route, now_us)
            self.grant_entry(policy, state, request_id, entry, tag, url, now_us)
            return True
        return False

    def routed_url(
        self,
        state: PoolState,
        ranked: Sequence[EndpointOffer],
        route: Route | None,
        now_us: int,
    ) -> str:
        """The engine a request goes to among ``ranked`` (``routing.pick_endpoint``), recorded
        as its prefix's and its session's engine (``lua/routes.py``)."""
        if route is None:
            return ranked[0].url
        depths = state.routes.depths(route, now_us)
        session_url = state.routes.session_url(route, now_us)
        ranked = state.routes.with_claims(ranked, now_us)
        offer, _, _ = pick_endpoint(ranked, state.inflight, route, depths, session_url)
        state.routes.granted(route, offer.url, now_us, new_row=depths.get(offer.url, 0) == 0)
        return offer.url

    def grant_entry(
        self,
        policy: PoolPolicy,
        state: PoolState,
        request_id: str,
        entry: Entry,
        tag: int | None,
        url: str,
        now_us: int,
        victim: str | None = None,
    ) -> None:
        """A waiting entry granted: its start tag served (``tag`` None: no fair order), its
        entry dropped, its lease on ``url``."""
        if tag is not None:
            state.fair[entry.level].served(tag)
        state._drop(request_id)
        self.grant(
            policy.name,
            request_id,
            entry.replica,
            entry.slots,
            url,
            now_us,
            tenant=entry.tenant,
            victim=victim,
        )

    def grant(
        self,
        pool_name: str,
        request_id: str,
        replica: str,
        slots: int,
        endpoint: str,
        now_us: int,
        *,
        tenant: str | None = None,
        victim: str | None = None,
    ) -> None:
        """A lease of ``slots`` on ``endpoint``, held for ``tenant``; a preempting one carries
        its ``victim`` tenant to the waiter (``lua/slots.py``'s ``grant``)."""
        state = self.pool(pool_name)
        state.set_lease(request_id, now_us + self.lease_ttl_us)
        state.hold_slots(request_id, endpoint, slots, tenant)
        state.num_dispatched += 1
        if victim is not None:
            state.num_preempting += 1
            endpoint = f"{endpoint}{PREEMPT_MARK}{victim}"
        self.deliver(pool_name, replica, request_id, endpoint)

    def deliver(self, pool_name: str, replica: str, request_id: str, endpoint: str) -> None:
        if replica in self.listeners:
            self.listeners[replica](pool_name, request_id, endpoint)


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
        drain_gap_us: int = 1_000_000,
        aging_us: int = DEFAULT_AGING_US,
        demote_after_us: int | None = None,
        only_if_absent: bool = False,
        slots: int = 1,
        tenant: str = DEFAULT_TENANT,
        weight: int = 1,
        deadline_gap_us: int = 0,
        route: Route | None = None,
    ) -> DispatchResult:
        check_enqueue(
            pool,
            priority,
            timeout_us,
            drain_gap_us=drain_gap_us,
            aging_us=aging_us,
            demote_after_us=demote_after_us,
            slots=slots,
            tenant=tenant,
            weight=weight,
            deadline_gap_us=deadline_gap_us,
        )
        now = self.hub.clock_us()
        state = self.hub.pool(pool.name)
        state.weights[tenant] = weight  # for the share (``preempt_share.py``)
        route = sendable_route(route)  # as the Redis scripts read it
        if only_if_absent and (request_id in state.queue or request_id in state.leases):
            return DispatchResult(len(state.queue), state.num_dispatched, 0)
        offers = sound_offers(offers)
        if offers and slots > most_slots(offers):
            raise NoEngineFitsError.of(pool.name, slots, most_slots(offers))
        # Nobody waits and a slot is free: the lease at once (``lua/scripts.py``).
        # A request that would wait for its engine queues instead.
        if not state.queue:
            ranked = rank_endpoints(offers, state.inflight, need=slots)
            if ranked and not cache_waits(state, offers, ranked, None, slots, now, route):
                url = self.hub.routed_url(state, ranked, route, now)
                self.hub.grant(
                    pool.name, request_id, self.replica_id, slots, url, now, tenant=tenant
                )
                return DispatchResult(len(state.queue), state.num_dispatched, 0)
        state.settle_promises(now, pool.max_queue_size)
        state.keep_promise(now)
        entry = Entry(self.replica_id, now + timeout_us, now, priority, slots, route, tenant)
        demote_at = 0
        if demote_after_us is not None and 0 < demote_after_us < timeout_us:
            demote_at = now + demote_after_us
        state.add(request_id, now + priority * aging_us, entry, demote_at)  # aging, as in Redis
        fair_before = state.add_fair(request_id, priority, tenant, weight, slots)
        result = self.hub.dispatch(pool, offers, self.replica_id, now)
        level = pool.level(priority)
        if (
            level.max_queue_size < pool.max_queue_size
            and request_id in state.queue
            and state.level_counts[priority] > level.max_queue_size
        ):
            # The level's own limit (``lua/scripts.py``): no promise, its queue's drain time.
            state._drop(request_id)
            state.undo_fair(priority, tenant, fair_before)
            ahead = state.level_counts.get(priority, 0) + 1
            retry_us = min(ahead * drain_gap_us, promise_horizon_us(pool))
            raise QueueFullError(
                f"queue of level {priority} of {pool.name!r} is full "
                f"({level.max_queue_size} waiting)",
                queue_depth=len(state.queue),
                num_dispatched_total=state.num_dispatched,
                retry_after_s=max(1, math.ceil(retry_us / 1_000_000)),
            )
        if deadline_gap_us and request_id in state.queue:
            # Deadline-aware refusal (``lua/scripts.py``): refused now, never timed out holding a
            # place.
            wait_us = predicted_wait_us(state.places_ahead(request_id, priority), deadline_gap_us)
            if wait_us > timeout_us:
                state._drop(request_id)
                state.undo_fair(priority, tenant, fair_before)
                raise DeadlineUnreachableError.of(
                    pool.name,
                    timeout_us,
                    retry_after_s=math.ceil((wait_us - timeout_us) / 1_000_000),
                )
        # A free slot takes anyone; a newcomer that has to wait may not take a place held for
        # a promised client.
        waiting = len(state.queue) + state.num_held
        if request_id in state.queue and waiting > pool.max_queue_size:
            state._drop(request_id)
            state.undo_fair(priority, tenant, fair_before)
            retry_us = state.promise_place(now, drain_gap_us, promise_horizon_us(pool))
            raise QueueFullError(
                f"queue of pool {pool.name!r} is full ({pool.max_queue_size} waiting)",
                queue_depth=len(state.queue),
                num_dispatched_total=state.num_dispatched,
                retry_after_s=max(1, retry_us // 1_000_000),
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

        def alive(replica: str) -> bool:  # the caller is alive, as in ``lua/prelude.py``
            return replica == self.replica_id or self.hub.is_alive(replica, now)

        self.hub.pool(pool.name).sweep(now, alive)
        return self.hub.dispatch(pool, offers, self.replica_id, now)

    async def heartbeat(
        self, leases: dict[str, list[tuple[str, str, int]]], *, restore: bool
    ) -> bool:
        now = self.hub.clock_us()
        was_alive = self.hub.alive_until.get(self.replica_id, 0) > now
        self.hub.alive_until[self.replica_id] = now + self.hub.lease_ttl_us
        for pool_name, held in leases.items():
            state = self.hub.pool(pool_name)
            for request_id, endpoint, slots in held:
                if not 1 <= slots <= MAX_LEASE_SLOTS:
                    continue  # a weight no lease can have: skipped, as in ``lua/epoch.py``
                if request_id in state.leases:
                    state.set_lease(request_id, now + self.hub.lease_ttl_us)
                elif restore:
                    state.set_lease(request_id, now + self.hub.lease_ttl_us)
                    state.hold_slots(request_id, endpoint, slots)
        return was_alive

    async def inflight(self, pool: PoolPolicy) -> dict[str, int]:
        return dict(self.hub.pool(pool.name).inflight)
