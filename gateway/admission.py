"""The admission front: how one gateway replica waits for, holds and gives back engine slots.

A request is queued in the shared backend (Redis or in-process), then waits on a local future.
Grants arrive three ways: in the result of this replica's own atomic steps (enqueue, release,
tick), through the backend's wake-up channel for grants made by another replica, and from the
short periodic tick that also sweeps expired leases and dead replicas' queue entries. No request
polls the backend on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TypeVar

from slotserve.gateway.admission_types import (
    AdmissionBackend,
    BackendUnavailableError,
    DispatchResult,
    PoolPolicy,
    QueueFullError,
    QueueTimeoutError,
)
from slotserve.gateway.routing import EndpointOffer, retry_after_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

OffersFn = Callable[[str], Sequence[EndpointOffer]]
PoolsFn = Callable[[], Sequence[PoolPolicy]]


@dataclass
class _Waiter:
    pool: PoolPolicy
    future: asyncio.Future[str]
    priority: int
    deadline: float  # monotonic


@dataclass(frozen=True)
class Lease:
    """A slot on ``endpoint`` held by one request until ``Admission.release``."""

    request_id: str
    pool: PoolPolicy
    endpoint: str
    queue_wait_s: float


class DrainRate:
    """Requests dispatched per second for one pool, from the backend's shared counter (EWMA)."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        self.half_life_s = half_life_s
        self.rate_per_s = 0.0
        self._last: tuple[float, int] | None = None

    def observe(self, now_s: float, num_dispatched_total: int) -> None:
        if self._last is None or num_dispatched_total < self._last[1]:
            self._last = (now_s, num_dispatched_total)
            return
        elapsed = now_s - self._last[0]
        if elapsed < 0.2:
            return
        sample = (num_dispatched_total - self._last[1]) / elapsed
        weight = 1 - 0.5 ** (elapsed / self.half_life_s)
        self.rate_per_s += weight * (sample - self.rate_per_s)
        self._last = (now_s, num_dispatched_total)


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
    ) -> None:
        self.backend = backend
        self.offers = offers
        self.pools = pools
        self.lease_ttl_s = lease_ttl_s
        self.tick_interval_s = tick_interval_s
        self.idle_tick_interval_s = idle_tick_interval_s
        self._waiters: dict[str, _Waiter] = {}
        self._leased: dict[str, tuple[str, str]] = {}  # request id -> (pool, endpoint)
        self._drain: dict[str, DrainRate] = {}
        self._queue_depth: dict[str, int] = {}
        self._hold_timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[object]] = set()
        self._needs_restore = False
        self._closing = False
        self.backend_ok = True

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start(self._on_grant)
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="admission-heartbeat"),
            asyncio.create_task(self._tick_loop(), name="admission-tick"),
        ]

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        # Bounded: a client library that turns a cancellation into its own error must not
        # keep shutdown waiting (the loops also stop on the closing flag).
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2)
        for handle in self._hold_timers.values():
            handle.cancel()
        await self.backend.close()

    # -- public API ---------------------------------------------------------------------------

    def queue_depth(self, pool_name: str) -> int:
        return self._queue_depth.get(pool_name, 0)

    def retry_after(self, pool_name: str, queue_depth: int | None = None) -> int:
        depth = self.queue_depth(pool_name) if queue_depth is None else queue_depth
        rate = self._drain.get(pool_name)
        return retry_after_seconds(depth, rate.rate_per_s if rate else 0.0)

    async def acquire(self, pool: PoolPolicy, priority: int, timeout_s: float) -> Lease:
        """Wait for a slot; raises QueueFullError, QueueTimeoutError or BackendUnavailableError."""
        started = time.monotonic()
        if self._needs_restore:
            await self._heartbeat_once()
        request_id = uuid.uuid4().hex
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = _Waiter(pool, future, priority, started + timeout_s)
        in_queue = False  # True while an entry or grant of ours may sit in the backend
        try:
            try:
                result = await self._call(
                    self.backend.enqueue(
                        pool,
                        self.offers(pool.name),
                        request_id,
                        priority,
                        int(timeout_s * 1_000_000),
                    )
                )
            except QueueFullError as exc:
                self._observe(pool.name, exc.queue_depth, exc.num_dispatched_total)
                exc.retry_after_s = self.retry_after(pool.name, exc.queue_depth)
                raise
            in_queue = True
            self._apply(pool, result)
            try:
                if future.done():  # granted in the enqueue step itself: the common fast path
                    endpoint = future.result()
                else:
                    endpoint = await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except TimeoutError:
                in_queue = False
                endpoint = await self._cancel(pool, request_id, future)
            in_queue = False
        finally:
            self._waiters.pop(request_id, None)
            if in_queue:
                # Cancelled (client gone) or failed: take the entry out, or hand a late grant back.
                self._spawn(self._abandon(pool, request_id))
        return Lease(request_id, pool, endpoint, time.monotonic() - started)

    async def release(self, lease: Lease) -> None:
        """Give the slot back (on the replica that acquired it; safe to repeat); never raises."""
        self._leased.pop(lease.request_id, None)
        try:
            result = await self._call(
                self.backend.release(lease.pool, self.offers(lease.pool.name), lease.request_id)
            )
        except BackendUnavailableError:
            return  # the lease expires by itself after the lease TTL
        self._apply(lease.pool, result)

    def release_soon(self, lease: Lease) -> None:
        """``release`` in its own task, so that a cancelled caller still gives the slot back."""
        self._spawn(self.release(lease))

    # -- internals ----------------------------------------------------------------------------

    async def _cancel(self, pool: PoolPolicy, request_id: str, future: asyncio.Future[str]) -> str:
        if future.done():
            return future.result()
        outcome = await self._call(self.backend.cancel(pool, request_id))
        if future.done():
            return future.result()
        if outcome.state == "granted":
            self._leased[request_id] = (pool.name, outcome.endpoint)
            return outcome.endpoint
        raise QueueTimeoutError(
            f"request waited longer than its queue timeout in pool {pool.name!r}",
            retry_after_s=self.retry_after(pool.name),
        )

    async def _abandon(self, pool: PoolPolicy, request_id: str) -> None:
        try:
            outcome = await self._call(self.backend.cancel(pool, request_id))
        except BackendUnavailableError:
            return
        if outcome.state == "granted":
            await self.release(Lease(request_id, pool, outcome.endpoint, 0.0))

    def _on_grant(self, pool_name: str, request_id: str, endpoint: str) -> None:
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            if not waiter.future.done():
                self._leased[request_id] = (pool_name, endpoint)
                waiter.future.set_result(endpoint)
            return
        if request_id in self._leased:
            return
        # Nobody here waits for it any more (timed out, client gone): give it back at once.
        policy = next((p for p in self.pools() if p.name == pool_name), None)
        if policy is not None:
            self.release_soon(Lease(request_id, policy, endpoint, 0.0))

    def _apply(self, pool: PoolPolicy, result: DispatchResult) -> None:
        for grant in result.grants:
            self._on_grant(pool.name, grant.request_id, grant.endpoint)
        self._observe(pool.name, result.queue_depth, result.num_dispatched_total)
        if result.hold_us > 0 and pool.name not in self._hold_timers:
            loop = asyncio.get_running_loop()
            self._hold_timers[pool.name] = loop.call_later(
                result.hold_us / 1_000_000, self._hold_expired, pool
            )

    def _hold_expired(self, pool: PoolPolicy) -> None:
        self._hold_timers.pop(pool.name, None)
        self._spawn(self._tick_pool(pool))

    def _observe(self, pool_name: str, queue_depth: int, num_dispatched_total: int) -> None:
        self._queue_depth[pool_name] = queue_depth
        rate = self._drain.setdefault(pool_name, DrainRate())
        rate.observe(time.monotonic(), num_dispatched_total)

    def _spawn(self, coro: Coroutine[object, object, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _call(self, awaitable: Awaitable[T]) -> T:
        try:
            result = await awaitable
        except BackendUnavailableError as exc:
            self._mark_down(exc)
            raise
        self.backend_ok = True
        return result

    def _mark_down(self, exc: BackendUnavailableError) -> None:
        if self.backend_ok:
            log.warning("%s; answering 503 until it returns", exc.message)
        self.backend_ok = False
        self._needs_restore = True

    async def _tick_pool(self, pool: PoolPolicy) -> None:
        try:
            result = await self._call(self.backend.tick(pool, self.offers(pool.name)))
        except BackendUnavailableError:
            return
        self._apply(pool, result)

    async def _tick_loop(self) -> None:
        while not self._closing:
            waiting_pools = {waiter.pool.name for waiter in self._waiters.values()}
            for pool in self.pools():
                try:
                    await self._tick_pool(pool)
                except Exception:  # a bug must not stop the sweeper of every other pool
                    log.exception("admission tick failed for pool %s", pool.name)
            interval = self.tick_interval_s if waiting_pools else self.idle_tick_interval_s
            await asyncio.sleep(interval)

    async def _heartbeat_once(self) -> None:
        held: dict[str, list[tuple[str, str]]] = {}
        for request_id, (pool_name, endpoint) in list(self._leased.items()):
            held.setdefault(pool_name, []).append((request_id, endpoint))
        restore = self._needs_restore
        try:
            was_alive = await self._call(self.backend.heartbeat(held, restore=restore))
            if was_alive and not restore:
                return
            if not was_alive:
                # Our heartbeat came too late (a stall longer than the lease TTL, or Redis lost
                # its data): take back the leases we still use before anything else.
                log.warning("this replica was presumed dead; restoring its leases and queue")
                await self._call(self.backend.heartbeat(held, restore=True))
            # Entries of our waiters may have been swept or lost: put back the missing ones.
            await self._requeue_waiters()
        except BackendUnavailableError:
            return
        self._needs_restore = False
        if restore:
            log.info("admission backend is back; restored %d leases", len(self._leased))

    async def _requeue_waiters(self) -> None:
        now = time.monotonic()
        for request_id, waiter in list(self._waiters.items()):
            if waiter.future.done():
                continue
            remaining_us = max(1, int((waiter.deadline - now) * 1_000_000))
            try:
                result = await self._call(
                    self.backend.enqueue(
                        waiter.pool,
                        self.offers(waiter.pool.name),
                        request_id,
                        waiter.priority,
                        remaining_us,
                        only_if_absent=True,
                    )
                )
            except QueueFullError as exc:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
                continue
            self._apply(waiter.pool, result)

    async def _heartbeat_loop(self) -> None:
        while not self._closing:
            try:
                await self._heartbeat_once()
            except Exception:  # keep heartbeating: a stopped heartbeat loses every lease
                log.exception("admission heartbeat failed")
            await asyncio.sleep(self.lease_ttl_s / 4 if not self._needs_restore else 0.2)
