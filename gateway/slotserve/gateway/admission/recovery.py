"""Keeping one replica's leases alive, and putting them back after the backend lost them.

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
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from slotserve.gateway.admission.types import AdmissionError, BackendUnavailableError

if TYPE_CHECKING:
    from slotserve.gateway.admission.front import Admission, Waiter

log = logging.getLogger(__name__)
T = TypeVar("T")
RESTORE_RETRY_S = 0.2


class LeaseKeeper:
    """The heartbeat of one replica, whether its backend is up, and its recovery after an
    outage."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
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
            interval = RESTORE_RETRY_S if self.needs_restore else self.admission.lease_ttl_s / 4
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
        admission = self.admission
        restore = self.needs_restore
        intact = await self.call(admission.backend.heartbeat(self._held(), restore=restore))
        if intact and not restore:
            return
        if not intact:
            # Our heartbeat came too late (a stall longer than the lease TTL) or the backend lost
            # its state: take back the leases we still use before anything else.
            log.warning("admission state lost or replica presumed dead; restoring leases")
            await self.call(admission.backend.heartbeat(self._held(), restore=True))
        # Entries of our waiters may have been swept or lost: put back the missing ones.
        await self._requeue_waiters()
        if self.needs_restore:
            log.info("admission backend is back; restored %d leases", len(admission.leased))
        self.needs_restore = False

    def _held(self) -> dict[str, list[tuple[str, str, int]]]:
        held: dict[str, list[tuple[str, str, int]]] = {}
        for request_id, (pool_name, endpoint, slots) in list(self.admission.leased.items()):
            held.setdefault(pool_name, []).append((request_id, endpoint, slots))
        return held

    async def _requeue_waiters(self) -> None:
        """Put back every waiter whose entry is gone, all at once (one pipeline)."""
        now = time.monotonic()
        waiting = [(rid, w) for rid, w in self.admission.waiters.items() if not w.future.done()]
        await asyncio.gather(*(self._requeue(rid, w, now) for rid, w in waiting))

    async def _requeue(self, request_id: str, waiter: Waiter, now: float) -> None:
        admission = self.admission
        remaining_us = max(1, int((waiter.deadline - now) * 1_000_000))
        demote_us = None  # a DELAY request keeps its demotion time (past: demoted at once)
        if waiter.demote_at is not None:
            demote_us = max(1, int((waiter.demote_at - now) * 1_000_000))
        try:
            result = await self.call(
                admission.backend.enqueue(
                    waiter.pool,
                    admission.offers(waiter.pool.name),
                    request_id,
                    waiter.priority,
                    remaining_us,
                    aging_us=admission.aging_us(waiter.pool),
                    demote_after_us=demote_us,
                    only_if_absent=True,
                    slots=waiter.slots,
                    tenant=waiter.tenant,
                    weight=waiter.weight,
                )
            )
        except BackendUnavailableError:
            raise
        except AdmissionError as exc:  # full, or no engine fits it any more: its answer
            if not waiter.future.done():
                waiter.future.set_exception(exc)
            return
        admission.apply(waiter.pool, result)
