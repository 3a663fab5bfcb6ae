"""Keeping one replica's leases alive, and putting them back after the backend lost them.

The keeper takes the replica's ``Ledger`` (its waiters and leases, written by the front) and the
backend; what a requeue step did goes back to the front through ``on_result``.

Every backend step goes through ``LeaseKeeper.call``, which keeps ``backend_ok`` (the up gauge)
and asks for a restore when a step finds the backend away. Every lease TTL / 4 the keeper renews
the replica's liveness and every lease it holds (one backend step). When the backend was
unreachable, or reports that its state is gone (a new admission epoch after FLUSHALL, a restart
without persistence or a failover), or the replica was presumed dead after a stall, the keeper
writes back the leases this replica still uses and requeues its waiters whose entries were lost.
Until that is done, this replica admits nothing new (``Admission.acquire`` waits for
``restore``), and the epoch keeps every other replica from dispatching into the lost leases
(see ``lua/scripts.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from slotserve.gateway.admission.ledger import Ledger, Waiter
from slotserve.gateway.admission.types import (
    AdmissionBackend,
    AdmissionError,
    BackendUnavailableError,
    DispatchResult,
    PoolPolicy,
)
from slotserve.gateway.pools.routing import EndpointOffer

log = logging.getLogger(__name__)
T = TypeVar("T")
RESTORE_RETRY_S = 0.2


class LeaseKeeper:
    """The heartbeat of one replica, whether its backend is up, and its recovery after an
    outage."""

    def __init__(
        self,
        ledger: Ledger,
        backend: AdmissionBackend,
        *,
        lease_ttl_s: float,
        offers: Callable[[str], Sequence[EndpointOffer]],
        aging_us: Callable[[PoolPolicy], int],
        on_result: Callable[[PoolPolicy, DispatchResult], None],
    ) -> None:
        self.ledger = ledger
        self.backend = backend
        self.lease_ttl_s = lease_ttl_s
        # What a requeue needs from the front: its pools' offers and aging step, and where
        # the step's result goes (queue depth, hold-back, lost state).
        self.offers = offers
        self.aging_us = aging_us
        self.on_result = on_result
        self.backend_ok = True
        self.needs_restore = False
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._stopped = False

    def request_restore(self) -> None:
        """The backend failed or lost state: restore on the next beat, which comes at once."""
        self.needs_restore = True
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await one backend step, keeping ``backend_ok`` current; a failure asks for a
        restore."""
        try:
            result = await awaitable
        except BackendUnavailableError as exc:
            if self.backend_ok:
                log.warning("%s; answering 503 until it returns", exc.message)
            self.backend_ok = False
            self.request_restore()
            raise
        self.backend_ok = True
        return result

    async def run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            try:
                await self.beat()
            except Exception:  # keep heartbeating: a stopped heartbeat loses every lease
                log.exception("admission heartbeat failed")
            interval = RESTORE_RETRY_S if self.needs_restore else self.lease_ttl_s / 4
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            if self.needs_restore:
                await asyncio.sleep(0.02)  # coalesce a burst of failures into one restore

    async def restore(self) -> None:
        """Restore now (raises BackendUnavailableError while the backend is still away)."""
        if self._lock.locked():  # a beat is running: its outcome is ours, no second one
            async with self._lock:
                pass
            if self.needs_restore:
                raise BackendUnavailableError("admission backend (Redis) is still recovering")
            return
        await self.beat(raise_unavailable=True)

    async def beat(self, *, raise_unavailable: bool = False) -> None:
        async with self._lock:  # one beat at a time: the loop and waiting requests share it
            try:
                await self._beat_once()
            except BackendUnavailableError:
                if raise_unavailable:
                    raise

    async def _beat_once(self) -> None:
        restore = self.needs_restore
        held = self.ledger.held_by_pool()
        intact = await self.call(self.backend.heartbeat(held, restore=restore))
        if intact and not restore:
            return
        if not intact:
            # Our heartbeat came too late (a stall longer than the lease TTL) or the backend lost
            # its state: take back the leases we still use before anything else.
            log.warning("admission state lost or replica presumed dead; restoring leases")
            await self.call(self.backend.heartbeat(self.ledger.held_by_pool(), restore=True))
        # Entries of our waiters may have been swept or lost: put back the missing ones.
        await self._requeue_waiters()
        if self.needs_restore:
            log.info("admission backend is back; restored %d leases", len(self.ledger.leases))
        self.needs_restore = False

    async def _requeue_waiters(self) -> None:
        """Put back every waiter whose entry is gone, all at once (one pipeline)."""
        now = time.monotonic()
        waiting = self.ledger.still_waiting()
        await asyncio.gather(*(self._requeue(rid, w, now) for rid, w in waiting))

    async def _requeue(self, request_id: str, waiter: Waiter, now: float) -> None:
        remaining_us = max(1, int((waiter.deadline - now) * 1_000_000))
        demote_us = None  # a DELAY request keeps its demotion time (past: demoted at once)
        if waiter.demote_at is not None:
            demote_us = max(1, int((waiter.demote_at - now) * 1_000_000))
        try:
            result = await self.call(
                self.backend.enqueue(
                    waiter.pool,
                    self.offers(waiter.pool.name),
                    request_id,
                    waiter.priority,
                    remaining_us,
                    aging_us=self.aging_us(waiter.pool),
                    demote_after_us=demote_us,
                    only_if_absent=True,
                    slots=waiter.slots,
                    tenant=waiter.tenant,
                    weight=waiter.weight,
                    route=waiter.route,
                )
            )
        except BackendUnavailableError:
            raise
        except AdmissionError as exc:  # full, or no engine fits it any more: its answer
            if not waiter.future.done():
                waiter.future.set_exception(exc)
            return
        self.on_result(waiter.pool, result)
