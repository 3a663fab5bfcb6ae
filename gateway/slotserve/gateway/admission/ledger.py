"""One replica's ledger: which of its requests wait for a slot, and which slots it holds.

The front writes it: a waiter from a request's enqueue until it leaves, a lease from its grant
until its release. The lease keeper (``recovery.py``) reads it: every beat renews the leases
held here, and after an outage it writes them back and puts back the lost entries of the
requests still waiting. Neither reads the other's state: both take this ledger.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import NamedTuple

from slotserve.gateway.admission.tenants import DEFAULT_TENANT
from slotserve.gateway.admission.types import PoolPolicy
from slotserve.gateway.pools.routing import Route


@dataclass
class Waiter:
    pool: PoolPolicy
    future: asyncio.Future[str]
    priority: int
    deadline: float  # monotonic
    demote_at: float | None = None  # monotonic; DELAY levels only
    slots: int = 1  # slots its lease will hold: one per choice (``n``)
    tenant: str = DEFAULT_TENANT  # its share within its level (``fair_share.py``)
    weight: int = 1
    route: Route | None = None  # what may prefer an engine for it (``routing.pick_endpoint``)


class HeldLease(NamedTuple):
    pool_name: str
    endpoint: str
    slots: int


# Pool name -> (request id, endpoint, slots) of every lease held in it: a heartbeat's argument.
HeldByPool = dict[str, list[tuple[str, str, int]]]


class Ledger:
    """The waiter and lease tables of one replica, keyed by request id."""

    def __init__(self) -> None:
        self.waiters: dict[str, Waiter] = {}
        self.leases: dict[str, HeldLease] = {}

    def add_waiter(self, request_id: str, waiter: Waiter) -> None:
        self.waiters[request_id] = waiter

    def remove_waiter(self, request_id: str) -> None:
        self.waiters.pop(request_id, None)

    def waiter(self, request_id: str) -> Waiter | None:
        return self.waiters.get(request_id)

    def still_waiting(self) -> list[tuple[str, Waiter]]:
        """The waiters not answered yet (granted or refused), with their request ids."""
        return [(rid, w) for rid, w in self.waiters.items() if not w.future.done()]

    def waiting_pools(self) -> set[str]:
        return {waiter.pool.name for waiter in self.waiters.values()}

    def hold(self, request_id: str, pool_name: str, endpoint: str, slots: int) -> None:
        self.leases[request_id] = HeldLease(pool_name, endpoint, slots)

    def drop(self, request_id: str) -> bool:
        """Forget a lease; whether it was held (a second release finds it gone)."""
        return self.leases.pop(request_id, None) is not None

    def holds(self, request_id: str) -> bool:
        return request_id in self.leases

    def held_by_pool(self) -> HeldByPool:
        held: HeldByPool = {}
        for request_id, (pool_name, endpoint, slots) in list(self.leases.items()):
            held.setdefault(pool_name, []).append((request_id, endpoint, slots))
        return held
