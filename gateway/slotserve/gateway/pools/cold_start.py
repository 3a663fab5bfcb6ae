"""A pool at zero: requests held in the queue while an engine starts, and their Retry-After.

A request that finds no usable endpoint of its pool waits in the shared queue like any other,
bounded by the pool's ``maxQueueSize`` and ``queueTimeoutSeconds``, instead of a 503 at once:
its queue entry is the demand the operator's scaler reads (queued > 0, no metrics window), and
the admission tick grants it as soon as an engine answers ``/load``. When none does in time, the
answer is 503 ``cold_start_timeout`` whose Retry-After is the cold start still to go: a pool
without engines drains nothing, so the drain estimate would say nothing useful.

The estimate: the pool's measured cold start (``status.coldStartSeconds`` of its InferencePool,
which the operator measures from pod creation to Ready), else the pools file's
``coldStartSeconds``, else the gateway's ``cold_start_seconds``. The clock of a cold start
starts when this replica first holds a request for the pool at zero, and starts again once a
held request was served or nothing was held for longer than a cold start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from slotserve.gateway.admission.types import AdmissionError, QueueTimeoutError
from slotserve.gateway.pools.config import Pool

T = TypeVar("T")


class ColdStartTimeoutError(QueueTimeoutError):
    """A request held for a pool at zero waited its whole queue timeout: no engine came up."""

    code = "cold_start_timeout"


@dataclass
class _Wake:
    started_s: float  # the first hold of this cold start (monotonic)
    last_held_s: float  # the latest hold (monotonic)


class ColdStarts:
    """This replica's view of its pools' cold starts (one per gateway app)."""

    def __init__(self, default_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_s = default_s
        self.clock = clock
        self._wakes: dict[str, _Wake] = {}

    def estimate_s(self, pool: Pool) -> float:
        """Seconds from asking for an engine to a ready one: measured, else configured."""
        return pool.cold_start_s if pool.cold_start_s is not None else self.default_s

    def hold(self, pool: Pool) -> None:
        """A request for ``pool`` is held because no engine of it is ready."""
        now = self.clock()
        wake = self._wakes.get(pool.model)
        if wake is None or now - wake.last_held_s > self.estimate_s(pool):
            self._wakes[pool.model] = _Wake(now, now)
        else:
            wake.last_held_s = now

    async def held(
        self, pool: Pool, acquire: Awaitable[T], *, waited_s: float, at_zero: Callable[[], bool]
    ) -> T:
        """Await ``acquire`` (admission) for a request held because ``pool`` has no ready
        engine; a failure comes out as ``explain`` makes it (``at_zero``: asked at that time)."""
        self.hold(pool)
        try:
            lease = await acquire
        except AdmissionError as exc:
            explained = self.explain(pool, exc, waited_s=waited_s, still_at_zero=at_zero())
            if explained is exc:
                raise
            raise explained from exc
        self.served(pool)
        return lease

    def served(self, pool: Pool) -> None:
        """A held request got its engine: this cold start is over."""
        self._wakes.pop(pool.model, None)

    def remaining_s(self, pool: Pool) -> int:
        """Whole seconds until an engine should be ready (at least 1: try again soon)."""
        wake = self._wakes.get(pool.model)
        elapsed = 0.0 if wake is None else self.clock() - wake.started_s
        return max(1, math.ceil(self.estimate_s(pool) - elapsed))

    def explain(
        self, pool: Pool, error: AdmissionError, *, waited_s: float, still_at_zero: bool
    ) -> AdmissionError:
        """The error for a held request: a timeout while the pool is still at zero becomes
        ``cold_start_timeout`` with the cold start's remaining time; anything else is kept
        (a full queue; a timeout behind others once an engine was up)."""
        if not (still_at_zero and isinstance(error, QueueTimeoutError)):
            return error
        return ColdStartTimeoutError(
            f"no engine of pool {pool.model!r} became ready while the request waited "
            f"({waited_s:.3g} s, its queue timeout); the pool is starting: its cold start "
            f"takes about {self.estimate_s(pool):g} s",
            retry_after_s=self.remaining_s(pool),
        )
