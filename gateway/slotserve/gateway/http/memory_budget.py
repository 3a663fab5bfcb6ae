"""A replica's budget for the bytes its requests hold while they wait and while they stream.

Every request reserves its body (``Content-Length``, else the largest body allowed) plus a fixed
overhead before its body is read, resizes that to the body it got, and grows it while its answer
is buffered (a stream's pending event, a whole answer); past the budget the request gets 503 with
``Retry-After`` (or its stream ends with an error event), never an OOM-kill that would cut every
stream of every pool on the replica.

The default budget is a share of the memory the container may still use at start, read as the
engine sizes its KV cache (``slotserve/host_memory.py``): the node's ``MemAvailable`` capped by
every cgroup limit above the process (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) minus that
cgroup's working set (usage less inactive file pages, what the kubelet compares with the limit).
"""

from __future__ import annotations

from aiohttp import web

from slotserve.host_memory import SYSTEM, MemorySources, available_memory_bytes

# aiohttp's request, transport and task, the handler's frames, admission's waiter: measured at
# ~25 KiB a held request; counted generously.
REQUEST_OVERHEAD_BYTES = 64 * 1024


def default_budget_bytes(fraction: float, sources: MemorySources = SYSTEM) -> int:
    return max(REQUEST_OVERHEAD_BYTES, int(available_memory_bytes(sources) * fraction))


class MemoryBudget:
    """Bytes held by this replica's requests, against a limit."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def reserve(self, num_bytes: int) -> Reservation | None:
        """A reservation of ``num_bytes``, or None when they do not fit now."""
        if self.held_bytes + num_bytes > self.limit_bytes:
            return None
        self.held_bytes += num_bytes
        return Reservation(self, num_bytes)


class Reservation:
    """What one request holds; ``resize`` may fail to grow, never to shrink."""

    def __init__(self, budget: MemoryBudget, num_bytes: int) -> None:
        self.budget = budget
        self.num_bytes = num_bytes

    def resize(self, num_bytes: int) -> bool:
        growth = num_bytes - self.num_bytes
        if growth > 0 and self.budget.held_bytes + growth > self.budget.limit_bytes:
            return False
        self.budget.held_bytes += growth
        self.num_bytes = num_bytes
        return True

    def release(self) -> None:
        self.budget.held_bytes -= self.num_bytes
        self.num_bytes = 0


# A request's Reservation, set by request_limits.py for every POST that matched a route.
RESERVATION = web.RequestKey("reservation", Reservation)


def request_reservation(request: web.Request) -> Reservation | None:
    """The bytes a request holds in the budget (None: the middleware did not run for it)."""
    return request.get(RESERVATION)
