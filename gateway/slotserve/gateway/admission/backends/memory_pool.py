"""One pool's state in the in-process backend: what the Redis backend's keys hold for a pool.

The queue and its entries, the leases and the slots they hold, the promised return times and the
fair queues of each level, each step with the Lua it mirrors (``lua/prelude.py``,
``lua/scripts.py``). ``memory.InProcessHub`` runs the steps; nothing here awaits.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from slotserve.gateway.admission.backends.memory_routes import RouteMemory
from slotserve.gateway.admission.fair_share import FairLevel
from slotserve.gateway.admission.types import (
    DEMOTION_OFFSET_US,
    MAX_WAIT_US,
    PROMISE_GRACE_US,
    PROMISE_MEMORY,
    PROMISE_WINDOW_US,
    kept_share,
)
from slotserve.gateway.pools.routing import Route

SWEEP_BATCH = 100  # as in the Redis backend: bounded work per step however long the queue
HEAD_DROPS = 16  # dead heads dropped one by one on the way to a live one (``lua/prelude.py``)
HEAD_DEMOTIONS = 64  # heads due for demotion (DELAY) demoted on the way, as in ``lua/prelude.py``


@dataclass
class StepBudget:
    """What one step may still do on the way to a live head (``lua/prelude.py``'s budgets)."""

    num_drops: int = HEAD_DROPS
    num_demotions: int = HEAD_DEMOTIONS
    num_refusals: int = SWEEP_BATCH


@dataclass
class Entry:
    replica: str
    deadline_us: int
    enqueued_us: int
    level: int
    slots: int = 1  # slots its lease will hold: one per choice (``n``)
    route: Route | None = None  # what may prefer an engine for it (prefix-aware routing)
    tenant: str | None = None  # whose slots its lease will hold (``preempt_share.py``)


@dataclass
class PoolState:
    """One pool's shared state. Heaps hold (key, request id) with lazy deletion: an item is
    live only while the dicts still agree with it."""

    queue: dict[str, int] = field(default_factory=dict)  # request id -> score
    # (score, id): equal scores in request-id order, as a Redis sorted set orders them
    queue_heap: list[tuple[int, str]] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    deadline_heap: list[tuple[int, str]] = field(default_factory=list)
    by_replica: dict[str, set[str]] = field(default_factory=dict)
    level_counts: dict[int, int] = field(default_factory=dict)  # level -> waiting
    delays: dict[str, int] = field(default_factory=dict)  # request id -> demoted at (us)
    delay_heap: list[tuple[int, str]] = field(default_factory=list)
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expiry (us)
    lease_heap: list[tuple[int, str]] = field(default_factory=list)
    lease_endpoint: dict[str, str] = field(default_factory=dict)
    lease_slots: dict[str, int] = field(default_factory=dict)  # request id -> slots held
    inflight: dict[str, int] = field(default_factory=dict)  # endpoint -> slots held
    num_dispatched: int = 0
    retry_horizon_us: int = 0
    promised: list[int] = field(default_factory=list)  # promised return times (us), sorted
    settled_us: int = 0  # due promises up to this time have opened their places
    num_kept: int = 0  # promises kept lately (halved with num_lapsed past PROMISE_MEMORY)
    num_lapsed: int = 0  # promises lapsed lately: their clients did not come back
    num_held: int = 0  # queue places held for promised clients
    num_near: int = 0  # promises due within PROMISE_WINDOW_US (the step's settle_promises)
    num_freed: int = 0  # leases released in the current step
    num_refused: int = 0  # queued requests refused: no offered engine had their slots
    fair: dict[int, FairLevel] = field(default_factory=dict)  # level -> its fair queue
    routes: RouteMemory = field(default_factory=RouteMemory)  # recent routings, sessions
    # Since when an engine's room has gone unused because the requests that could take it wait
    # for their own engines (``P:{pool}:route_waits``'s ``=room``); None: no such room now.
    room_idle_since_us: int | None = None
    # Tenant preemption (``preempt_share.py``, ``lua/preempt.py``): slots held per tenant, in
    # the pool and per (tenant, endpoint), kept with the leases; weights as last enqueued.
    lease_tenant: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    tenant_held: dict[str, int] = field(default_factory=dict)
    tenant_held_at: dict[tuple[str, str], int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    num_preempting: int = 0  # preempting grants made

    def add(self, request_id: str, score: int, entry: Entry, demote_at_us: int = 0) -> None:
        self.queue[request_id] = score
        self.entries[request_id] = entry
        heapq.heappush(self.queue_heap, (score, request_id))
        heapq.heappush(self.deadline_heap, (entry.deadline_us, request_id))
        self.by_replica.setdefault(entry.replica, set()).add(request_id)
        self.level_counts[entry.level] = self.level_counts.get(entry.level, 0) + 1
        if demote_at_us:
            self.delays[request_id] = demote_at_us
            heapq.heappush(self.delay_heap, (demote_at_us, request_id))

    def add_fair(
        self, request_id: str, level: int, tenant: str, weight: int, slots: int
    ) -> int | None:
        """Tag a new entry with its tenant's fair start (``fair_share.py``)."""
        return self.fair.setdefault(level, FairLevel()).add(request_id, tenant, weight, slots)

    def undo_fair(self, level: int, tenant: str, before: int | None) -> None:
        """A refused newcomer's tenant gets its finish tag back (while its level waits)."""
        if self.level_counts.get(level, 0) > 0:
            self.fair.setdefault(level, FairLevel()).undo(tenant, before)

    def demote(self, request_id: str) -> None:
        """DELAY: behind every request not demoted, order among the demoted kept."""
        self.delays.pop(request_id, None)
        score = self.queue[request_id] + DEMOTION_OFFSET_US
        self.queue[request_id] = score
        heapq.heappush(self.queue_heap, (score, request_id))
        entry = self.entries.get(request_id)
        if entry is not None and entry.level in self.fair:
            self.fair[entry.level].demote(request_id)

    def head(
        self, now_us: int, alive: Callable[[str], bool], budget: StepBudget
    ) -> tuple[str, Entry, int | None] | None:
        """The queue's head says which level has the turn; within it the lowest fair start tag
        goes (``lua/prelude.py``'s ``head``, budgets alike). Returns the entry and its tag."""
        while budget.num_drops > 0:
            heap = self.queue_heap
            while heap and self.queue.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            if not heap:
                return None
            request_id, tag = heap[0][1], None
            entry = self.entries.get(request_id)
            if entry is not None:
                fair = self.fair.get(entry.level)
                picked = fair.head() if fair is not None else None
                head_due = self.delays.get(request_id, now_us + 1) <= now_us
                if picked is not None and picked[0] != request_id and not head_due:
                    request_id = picked[0]
                    entry = self.entries.get(request_id)
                if picked is not None and picked[0] == request_id:
                    tag = picked[1]
            if entry is not None and self.delays.get(request_id, now_us + 1) <= now_us:
                if budget.num_demotions == 0:
                    return None  # the tick demotes the rest in batches
                self.demote(request_id)
                budget.num_demotions -= 1
                continue
            if entry is not None and entry.deadline_us > now_us and alive(entry.replica):
                return request_id, entry, tag
            self._drop(request_id)
            budget.num_drops -= 1
        return None

    def fair_window(self, level: int, size: int) -> list[tuple[str, int]]:
        """The first ``size`` entries of ``level`` in fair order, with their start tags (the
        Lua's ``ZRANGE fairq 0 size-1``)."""
        fair = self.fair.get(level)
        return fair.first(size) if fair is not None else []

    def _drop(self, request_id: str) -> None:
        self.queue.pop(request_id, None)
        if not self.queue:
            self.room_idle_since_us = None  # nobody waits: as the scripts' touch() clears it
        self.delays.pop(request_id, None)
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.by_replica.get(entry.replica, set()).discard(request_id)
            if entry.level in self.fair:
                self.fair[entry.level].remove(request_id)
            self.level_counts[entry.level] -= 1
            if self.level_counts[entry.level] <= 0:
                del self.level_counts[entry.level]
                self.fair.pop(entry.level, None)  # its next busy period starts afresh

    def set_lease(self, request_id: str, expiry_us: int) -> None:
        self.leases[request_id] = expiry_us
        heapq.heappush(self.lease_heap, (expiry_us, request_id))

    def hold_slots(
        self, request_id: str, endpoint: str, slots: int, tenant: str | None = None
    ) -> None:
        """A new lease weighs its slots (``lua/slots.py``), counted for its tenant."""
        self.lease_endpoint[request_id] = endpoint
        self.lease_slots[request_id] = slots
        self.inflight[endpoint] = self.inflight.get(endpoint, 0) + slots
        if tenant is not None:
            self.lease_tenant[request_id] = tenant
            self._count_held(tenant, endpoint, slots)

    def _count_held(self, tenant: str, endpoint: str, delta: int) -> None:
        """``lua/preempt.py``'s ``count_held``: a count that reaches zero is gone."""
        held = self.tenant_held.get(tenant, 0) + delta
        if held > 0:
            self.tenant_held[tenant] = held
        else:
            self.tenant_held.pop(tenant, None)
        at = self.tenant_held_at.get((tenant, endpoint), 0) + delta
        if at > 0:
            self.tenant_held_at[(tenant, endpoint)] = at
        else:
            self.tenant_held_at.pop((tenant, endpoint), None)

    def free_lease(self, request_id: str) -> bool:
        if self.leases.pop(request_id, None) is None:
            return False
        self.num_freed += 1
        endpoint = self.lease_endpoint.pop(request_id, "")
        slots = self.lease_slots.pop(request_id, 1)
        tenant = self.lease_tenant.pop(request_id, None)
        if tenant is not None:
            self._count_held(tenant, endpoint, -slots)
        self.inflight[endpoint] = self.inflight.get(endpoint, 0) - slots
        if self.inflight[endpoint] <= 0:
            del self.inflight[endpoint]
        return True

    def sweep(self, now_us: int, alive: Callable[[str], bool]) -> None:
        """Expired leases and queue entries, oldest first, then dead replicas' entries: each at
        most SWEEP_BATCH per step."""
        self.routes.sweep(now_us)
        for _ in range(SWEEP_BATCH):
            if not self.lease_heap or self.lease_heap[0][0] > now_us:
                break
            expiry, request_id = heapq.heappop(self.lease_heap)
            if self.leases.get(request_id) == expiry:
                self.free_lease(request_id)
        for _ in range(SWEEP_BATCH):
            if not self.deadline_heap or self.deadline_heap[0][0] > now_us:
                break
            deadline, request_id = heapq.heappop(self.deadline_heap)
            entry = self.entries.get(request_id)
            if entry is not None and entry.deadline_us == deadline:
                self._drop(request_id)
        for _ in range(SWEEP_BATCH):
            if not self.delay_heap or self.delay_heap[0][0] > now_us:
                break
            demote_at, request_id = heapq.heappop(self.delay_heap)
            if self.delays.get(request_id) == demote_at:
                self.demote(request_id)
        for replica, request_ids in list(self.by_replica.items()):
            if not alive(replica):
                for request_id in list(request_ids)[:SWEEP_BATCH]:
                    self._drop(request_id)
            if not request_ids:
                del self.by_replica[replica]

    def settle_promises(self, now_us: int, max_queue_size: int) -> None:
        """Promises now due open the places held for them; only promises due within the
        window hold one, and at most 3/4 of the queue; promises due longer than the grace ago
        lapse (as ``settle_promises`` in Lua)."""
        promised = self.promised
        num_due = max(
            0,
            bisect.bisect_right(promised, now_us) - bisect.bisect_right(promised, self.settled_us),
        )
        self.settled_us = now_us
        num_lapsed = bisect.bisect_right(promised, now_us - PROMISE_GRACE_US)
        del promised[:num_lapsed]
        self.count_promises(0, num_lapsed)
        num_near = bisect.bisect_right(promised, now_us + PROMISE_WINDOW_US) - bisect.bisect_right(
            promised, now_us
        )
        self.num_near = kept_share(num_near, self.num_kept, self.num_lapsed)
        held = min(max(0, self.num_held - num_due), self.num_near, max_queue_size * 3 // 4)
        self.num_held = held

    def places_ahead(self, request_id: str, level: int) -> int:
        """Entries of other levels before it in the queue (its rank less the others of its
        level), and those of its level before it in fair order (``lua/scripts.py``; O(queue))."""
        own = (self.queue[request_id], request_id)
        rank = sum(1 for rid, score in self.queue.items() if (score, rid) < own)
        others = max(0, rank - (self.level_counts.get(level, 1) - 1))
        fair = self.fair.get(level)
        if fair is None or request_id not in fair.tags:
            return others
        tag = (fair.tags[request_id], request_id)
        return others + sum(1 for rid, t in fair.tags.items() if (t, rid) < tag)

    def keep_promise(self, now_us: int) -> None:
        """An arrival while promises are due keeps the latest due one (``lua/prelude.py``)."""
        latest = bisect.bisect_right(self.promised, now_us) - 1
        if latest >= 0 and self.promised[latest] > now_us - PROMISE_GRACE_US:
            del self.promised[latest]
            self.count_promises(1, 0)

    def count_promises(self, kept: int, lapsed: int) -> None:
        if kept + lapsed == 0:
            return
        kept, lapsed = self.num_kept + kept, self.num_lapsed + lapsed
        while kept + lapsed > PROMISE_MEMORY:
            kept, lapsed = kept // 2, lapsed // 2
        self.num_kept, self.num_lapsed = kept, lapsed

    def hold_freed_places(self, max_queue_size: int) -> None:
        """Capacity freed by released leases is held for promised clients (``lua/prelude.py``)."""
        if self.num_freed == 0:
            return
        room = max_queue_size - len(self.queue)
        held = min(self.num_held + self.num_freed, self.num_near, room, max_queue_size * 3 // 4)
        self.num_held = max(0, held)
        self.num_freed = 0

    def promise_place(self, now_us: int, drain_gap_us: int, max_ahead_us: int) -> int:
        """A rejected client's Retry-After (whole seconds, in us): the next place that frees
        after every place already promised, at most ``max_ahead_us`` ahead, and never later
        than the drain at ``drain_gap_us`` of the queue and of the live promises, in the share
        kept (``lua/prelude.py``)."""
        live = kept_share(len(self.promised), self.num_kept, self.num_lapsed)
        ahead = min(len(self.queue) + live, MAX_WAIT_US // drain_gap_us + 1)
        last = min(self.retry_horizon_us, now_us + ahead * drain_gap_us)
        if last - now_us >= max_ahead_us:
            return math.ceil((last - now_us) / 1_000_000) * 1_000_000
        self.retry_horizon_us = max(now_us, last) + drain_gap_us
        retry_us = math.ceil((self.retry_horizon_us - now_us) / 1_000_000) * 1_000_000
        bisect.insort(self.promised, now_us + retry_us)
        return retry_us
