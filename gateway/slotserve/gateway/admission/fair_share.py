"""Weighted fair share within a priority level: the in-process twin of ``lua/fair.py``.

Start-time fair queuing, one ``FairLevel`` per level of a pool: ``fields`` is what
``P:{pool}:fair:{level}`` holds (``=v`` -> the level's virtual time V, tenant -> its finish tag F)
and ``tags`` what ``P:{pool}:fairq:{level}`` holds (request id -> start tag). ``lua/fair.py``
says why SFQ, and how it sits with the levels' order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from slotserve.gateway.admission.types import DEMOTION_OFFSET_US, MAX_WEIGHT

# One slot of a weight-1 tenant moves its finish tag this far; divisible by 1..10 (and most
# weights people write), so small weights' shares are exact integers.
FAIR_UNIT = 2_520_000
V_FIELD = "=v"  # a tenant's name never starts with '='
__all__ = ["FAIR_UNIT", "MAX_WEIGHT", "V_FIELD", "FairLevel", "fair_cost"]


def fair_cost(slots: int, weight: int) -> int:
    """How far one entry moves its tenant's finish tag."""
    return slots * (FAIR_UNIT // weight)


@dataclass
class FairLevel:
    fields: dict[str, int] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)
    heap: list[tuple[int, str]] = field(default_factory=list)  # lazy: live while tags agree

    def add(self, request_id: str, tenant: str, weight: int, slots: int) -> int | None:
        """Tag a new entry ``max(V, F)``; returns the tenant's F before (None: it had none)."""
        before = self.fields.get(tenant)
        start = max(self.fields.get(V_FIELD, 0), before or 0)
        self.fields[tenant] = start + fair_cost(slots, weight)
        self._tag(request_id, start)
        return before

    def undo(self, tenant: str, before: int | None) -> None:
        if before is None:
            self.fields.pop(tenant, None)
        else:
            self.fields[tenant] = before

    def head(self) -> tuple[str, int] | None:
        while self.heap and self.tags.get(self.heap[0][1]) != self.heap[0][0]:
            heapq.heappop(self.heap)
        if not self.heap:
            return None
        tag, request_id = self.heap[0]
        return request_id, tag

    def first(self, size: int) -> list[tuple[str, int]]:
        """The first ``size`` live entries in fair order, (request id, start tag) by (tag, id):
        the Lua's ``ZRANGE fairq 0 size-1``. Walks the heap best-first from its root, so it
        costs the entries it passes (stale ones included), not the level's."""
        out: list[tuple[str, int]] = []
        seen: set[str] = set()  # a request re-tagged alike is in the heap twice
        frontier = [(self.heap[0], 0)] if self.heap else []
        while frontier and len(out) < size:
            (tag, request_id), index = heapq.heappop(frontier)
            if self.tags.get(request_id) == tag and request_id not in seen:
                seen.add(request_id)
                out.append((request_id, tag))
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(self.heap):
                    heapq.heappush(frontier, (self.heap[child], child))
        return out

    def remove(self, request_id: str) -> None:
        self.tags.pop(request_id, None)

    def demote(self, request_id: str) -> None:
        if request_id in self.tags:
            self._tag(request_id, self.tags[request_id] + DEMOTION_OFFSET_US)

    def served(self, tag: int) -> None:
        if tag < DEMOTION_OFFSET_US and tag > self.fields.get(V_FIELD, 0):
            self.fields[V_FIELD] = tag

    def _tag(self, request_id: str, tag: int) -> None:
        self.tags[request_id] = tag
        heapq.heappush(self.heap, (tag, request_id))
