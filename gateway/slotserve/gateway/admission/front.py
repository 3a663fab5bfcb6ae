"""The admission front: how one gateway replica waits for, holds and gives back engine slots.

A request is queued in the shared backend (Redis or in-process), then waits on a local future.
Grants arrive three ways: from this replica's own atomic steps (enqueue, release,
tick), through the backend's wake-up channel for grants made by another replica, and from the
short periodic tick that also sweeps expired leases and dead replicas' queue entries. No request
polls the backend on its own.

Ownership: a grant is either delivered to a waiter that is still there or released at once.
The backends hand every grant to ``_on_grant`` as the step finishes, not to the caller, so a
caller cancelled while its enqueue step is in flight (the client went away) drops nothing; a
caller that leaves without a lease hands its request to ``_abandon``, which takes the entry out
or gives the late grant back.

Which requests wait here and which leases this replica holds is the ``Ledger``'s
(``ledger.py``); the front writes it. Outages are ``recovery.LeaseKeeper``'s job: every backend
step goes through it (``call``), it keeps the ledger's leases alive, and after an outage it puts
them back and requeues the ledger's waiters before ``acquire`` admits anything new.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TypeVar

from slotserve.gateway.admission.drain import (
    DrainRate,
    HoldTime,
    engines_rate_per_s,
    promise_gap_us,
    queue_drain_seconds,
    service_rate_per_s,
    wait_gap_us,
)
from slotserve.gateway.admission.ledger import Ledger, Waiter
from slotserve.gateway.admission.preempt_share import split_grant
from slotserve.gateway.admission.recovery import LeaseKeeper
from slotserve.gateway.admission.tenants import DEFAULT_TENANT
from slotserve.gateway.admission.types import (
    DEFAULT_AGING_US,
    REFUSED,
    AdmissionBackend,
    AdmissionError,
    BackendUnavailableError,
    DispatchResult,
    NoEngineFitsError,
    PoolPolicy,
    QueueFullError,
    QueueTimeoutError,
)
from slotserve.gateway.pools.routing import EndpointOffer, Route, most_slots

log = logging.getLogger(__name__)
T = TypeVar("T")

OffersFn = Callable[[str], Sequence[EndpointOffer]]
PoolsFn = Callable[[], Sequence[PoolPolicy]]

__all__ = ["Admission", "DrainRate", "Lease"]


@dataclass(frozen=True)
class Lease:
    """``slots`` slots on ``endpoint`` held by one request until ``Admission.release``."""

    request_id: str
    pool: PoolPolicy
    endpoint: str
    queue_wait_s: float
    granted_at: float = 0.0  # monotonic; 0 for leases handed back unused
    slots: int = 1  # one per choice the request asks for (``n``)
    # A preempting grant (``preempt_share.py``): the tenant whose running answer it may take
    # the slot of; the proxy tells the engine (``x-slotserve-preempt``).
    preempt_tenant: str | None = None


class Admission:
    """Admission for one gateway replica over a shared backend."""

    def __init__(
        self,
        backend: AdmissionBackend,
        offers: OffersFn,
        pools: PoolsFn,
        *,
        lease_ttl_s: float = 10.0,
        tick_interval_s: float = 0.1,
        idle_tick_interval_s: float = 0.5,
        priority_aging_s: float = DEFAULT_AGING_US / 1e6,
        deadline_refusal: bool = False,
    ) -> None:
        self.backend = backend
        self.offers = offers
        self.pools = pools
        self.lease_ttl_s = lease_ttl_s
        self.tick_interval_s = tick_interval_s
        self.idle_tick_interval_s = idle_tick_interval_s
        self.aging_us_default = int(priority_aging_s * 1_000_000)
        # Refuse at once (429 deadline) a request whose predicted wait exceeds what it may wait.
        self.deadline_refusal = deadline_refusal
        self.ledger = Ledger()
        self._drain: dict[str, DrainRate] = {}
        self._hold: dict[str, HoldTime] = {}
        self._queue_depth: dict[str, int] = {}
        self._hold_timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[object]] = set()
        self._closing = False
        self.keeper = LeaseKeeper(
            self.ledger,
            backend,
            lease_ttl_s=lease_ttl_s,
            offers=offers,
            aging_us=self.aging_us,
            on_result=self.apply,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start(self._on_grant)
        self._tasks = [
            asyncio.create_task(self.keeper.run(), name="admission-heartbeat"),
            asyncio.create_task(self._tick_loop(), name="admission-tick"),
        ]

    async def close(self) -> None:
        self._closing = True
        self.keeper.stop()
        for task in self._tasks:
            task.cancel()
        # Bounded: a client library that turns a cancellation into its own error must not
        # keep shutdown waiting (the loops also stop on the closing flag).
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2)
        for handle in self._hold_timers.values():
            handle.cancel()
        if self._background:  # releases and cancels on their way: give them a moment
            await asyncio.wait(set(self._background), timeout=2)
        await self.backend.close()

    # -- public API ---------------------------------------------------------------------------

    def queue_depth(self, pool_name: str) -> int:
        return self._queue_depth.get(pool_name, 0)

    def service_rate(self, pool_name: str) -> float:
        """Requests per second the pool drains (measured), else the engines' speed, else 0."""
        offers = self.offers(pool_name)
        num_slots = sum(offer.slots_total for offer in offers)
        drain, hold = self._drain.get(pool_name), self._hold.get(pool_name)
        return service_rate_per_s(drain, hold, num_slots, engines_rate_per_s(offers))

    def deadline_gap_us(self, pool_name: str) -> int:
        """The gap that predicts a queued request's wait (0: no deadline-aware refusal, or
        nothing measured yet: never refuse on a guess)."""
        if not self.deadline_refusal:
            return 0
        return wait_gap_us(self.service_rate(pool_name))

    def retry_after(self, pool_name: str, queue_depth: int | None = None) -> int:
        depth = self.queue_depth(pool_name) if queue_depth is None else queue_depth
        return queue_drain_seconds(depth, self.service_rate(pool_name))

    async def acquire(
        self,
        pool: PoolPolicy,
        priority: int,
        timeout_s: float,
        *,
        demote_after_s: float | None = None,
        slots: int = 1,
        tenant: str = DEFAULT_TENANT,
        weight: int = 1,
        route: Route | None = None,
    ) -> Lease:
        """Wait for a slot; raises QueueFullError, QueueTimeoutError or BackendUnavailableError.

        ``demote_after_s`` (a ``DELAY`` level, ``PoolPolicy.queue_wait``): from then on the
        request waits behind every request not demoted, until ``timeout_s``. ``slots``: the
        lease holds that many slots of one endpoint (a request's ``n``, one per choice).
        ``tenant`` and its ``weight``: within its level, the request waits for its tenant's
        weighted fair share of the pool, across every replica (``fair_share.py``).
        ``route``: the engine its cached prefix or its session prefers, among those with room
        (``routing.pick_endpoint``).
        """
        started = time.monotonic()
        if self.keeper.needs_restore:
            await self.keeper.restore()  # our leases first: nobody may over-admit into them
        request_id = uuid.uuid4().hex
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        demote_at = None if demote_after_s is None else started + demote_after_s
        waiter = Waiter(
            pool, future, priority, started + timeout_s, demote_at, slots, tenant, weight, route
        )
        self.ledger.add_waiter(request_id, waiter)
        owned = settled = False
        try:
            try:
                await self._enqueue(request_id, waiter, timeout_s, demote_after_s)
            except BackendUnavailableError:
                raise
            except AdmissionError:
                settled = True  # full, unfit or invalid: the step wrote no entry (or took it out)
                raise
            try:
                if future.done():  # granted in the enqueue step itself: the common fast path
                    endpoint = future.result()
                else:
                    remaining = started + timeout_s - time.monotonic()
                    endpoint = await asyncio.wait_for(asyncio.shield(future), max(0, remaining))
            except TimeoutError:
                endpoint = await self._cancel_at_deadline(pool, request_id, future, slots)
            owned = True
        except (QueueTimeoutError, NoEngineFitsError):
            settled = True  # timed out and taken out; or refused at the head, nothing held
            raise
        finally:
            self.ledger.remove_waiter(request_id)
            if not owned and not settled:
                # Cancelled (client gone) or failed: a grant made meanwhile reaches
                # ``_on_grant``, finds no waiter and is released; take the entry out too.
                self.spawn(self._abandon(pool, request_id, slots))
        now = time.monotonic()
        url, victim = split_grant(endpoint)
        return Lease(request_id, pool, url, now - started, now, slots, victim)

    async def release(self, lease: Lease) -> None:
        """Give the slot back (on the replica that acquired it; safe to repeat); never raises."""
        if self.ledger.drop(lease.request_id) and lease.granted_at:
            self._hold.setdefault(lease.pool.name, HoldTime()).observe(
                time.monotonic() - lease.granted_at
            )
        try:
            result = await self.call(
                self.backend.release(lease.pool, self.offers(lease.pool.name), lease.request_id)
            )
        except BackendUnavailableError:
            return  # not renewed any more: the lease expires by itself after the lease TTL
        self.apply(lease.pool, result)

    def release_soon(self, lease: Lease) -> None:
        """``release`` in its own task, so that a cancelled caller still gives the slot back."""
        self.spawn(self.release(lease))

    # -- internals ----------------------------------------------------------------------------

    def aging_us(self, pool: PoolPolicy) -> int:
        """The pool's priority aging step, else this gateway's."""
        if pool.priority_aging_s is None:
            return self.aging_us_default
        return int(pool.priority_aging_s * 1_000_000)

    async def _enqueue(
        self, request_id: str, waiter: Waiter, timeout_s: float, demote_after_s: float | None
    ) -> None:
        pool = waiter.pool
        demote_us = None if demote_after_s is None else int(demote_after_s * 1_000_000)
        try:
            result = await self.call(
                self.backend.enqueue(
                    pool,
                    self.offers(pool.name),
                    request_id,
                    waiter.priority,
                    int(timeout_s * 1_000_000),
                    drain_gap_us=promise_gap_us(self.service_rate(pool.name)),
                    aging_us=self.aging_us(pool),
                    demote_after_us=demote_us,
                    slots=waiter.slots,
                    tenant=waiter.tenant,
                    weight=waiter.weight,
                    deadline_gap_us=self.deadline_gap_us(pool.name),
                    route=waiter.route,
                )
            )
        except QueueFullError as exc:
            self._observe(pool.name, exc.queue_depth, exc.num_dispatched_total)
            raise
        self.apply(pool, result)

    async def _cancel_at_deadline(
        self, pool: PoolPolicy, request_id: str, future: asyncio.Future[str], slots: int
    ) -> str:
        if future.done():
            return future.result()
        outcome = await self.call(self.backend.cancel(pool, request_id))
        if future.done():
            return future.result()
        if outcome.state == "granted":
            self.ledger.hold(request_id, pool.name, outcome.endpoint, slots)
            return outcome.endpoint
        raise QueueTimeoutError(
            f"request waited longer than its queue timeout in pool {pool.name!r}",
            retry_after_s=self.retry_after(pool.name),
        )

    async def _abandon(self, pool: PoolPolicy, request_id: str, slots: int) -> None:
        """The waiter left without a lease: take its entry out or give its grant back."""
        delay_s, give_up_at = 0.1, time.monotonic() + self.lease_ttl_s
        while True:
            try:
                outcome = await self.call(self.backend.cancel(pool, request_id))
                break
            except BackendUnavailableError:
                # Retried while it can matter; after a lease TTL the backend forgets it anyway.
                if self._closing or time.monotonic() + delay_s > give_up_at:
                    return
                await asyncio.sleep(delay_s)
                delay_s = min(1.0, delay_s * 2)
        if outcome.state == "granted":
            self.ledger.hold(request_id, pool.name, outcome.endpoint, slots)
            await self.release(Lease(request_id, pool, outcome.endpoint, 0.0))

    def _on_grant(self, pool_name: str, request_id: str, endpoint: str) -> None:
        waiter = self.ledger.waiter(request_id)
        if endpoint == REFUSED:  # at the head, no ready engine had its slots: nothing is held
            if waiter is not None and not waiter.future.done():
                most = most_slots(self.offers(pool_name))
                waiter.future.set_exception(NoEngineFitsError.of(pool_name, waiter.slots, most))
            return
        url, _ = split_grant(endpoint)  # a preempting grant's victim goes to its waiter
        if waiter is not None and not waiter.future.done():
            self.ledger.hold(request_id, pool_name, url, waiter.slots)
            waiter.future.set_result(endpoint)
            return
        if self.ledger.holds(request_id):
            return  # already ours (the grant came twice: in a reply and on the grant list)
        # Nobody here waits for it any more (timed out, client gone): give it back at once.
        policy = next((p for p in self.pools() if p.name == pool_name), PoolPolicy(pool_name))
        self.release_soon(Lease(request_id, policy, url, 0.0))

    def apply(self, pool: PoolPolicy, result: DispatchResult) -> None:
        """Take in what one backend step did: queue depth, hold-back, lost state."""
        self._observe(pool.name, result.queue_depth, result.num_dispatched_total)
        if result.state_lost:
            self.keeper.request_restore()
        if result.hold_us > 0 and pool.name not in self._hold_timers:
            loop = asyncio.get_running_loop()
            self._hold_timers[pool.name] = loop.call_later(
                result.hold_us / 1_000_000, self._hold_expired, pool
            )

    def _hold_expired(self, pool: PoolPolicy) -> None:
        self._hold_timers.pop(pool.name, None)
        self.spawn(self.tick_pool(pool))

    def _observe(self, pool_name: str, queue_depth: int, num_dispatched_total: int) -> None:
        self._queue_depth[pool_name] = queue_depth
        rate = self._drain.setdefault(pool_name, DrainRate())
        rate.observe(time.monotonic(), num_dispatched_total)

    def spawn(self, coro: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await one backend step (``LeaseKeeper.call``: an outage starts its recovery)."""
        return await self.keeper.call(awaitable)

    @property
    def backend_ok(self) -> bool:
        """Whether the last backend step reached the backend (the up gauge)."""
        return self.keeper.backend_ok

    async def tick_pool(self, pool: PoolPolicy) -> None:
        try:
            result = await self.call(self.backend.tick(pool, self.offers(pool.name)))
        except BackendUnavailableError:
            return
        self.apply(pool, result)

    async def _tick_loop(self) -> None:
        while not self._closing:
            waiting_pools = self.ledger.waiting_pools()
            for pool in self.pools():
                try:
                    await self.tick_pool(pool)
                except Exception:  # a bug must not stop the sweeper of every other pool
                    log.exception("admission tick failed for pool %s", pool.name)
            interval = self.tick_interval_s if waiting_pools else self.idle_tick_interval_s
            await asyncio.sleep(interval)
