"""How fast a pool's queue drains, and the Retry-After that follows from it (pure, no I/O).

The drain rate is the engines' measured speed: slots divided by the mean time a request held its
slot. Before any request has finished here, the backend's shared ``dispatched`` counter (grants
by every replica) gives the pool's rate, and before any drain has been seen, the speed the
engines report in their ``/load`` (``mean_request_seconds``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from slotserve.gateway.admission.types import MAX_WAIT_US
from slotserve.gateway.pools.routing import EndpointOffer

# Rejected clients are promised places a little further apart than the measured drain: a
# retry that comes back slightly late still finds its place, one that comes early may not.
PROMISE_SAFETY = 0.85
UNKNOWN_GAP_US = 1_000_000  # nothing measured yet: promise one place a second


class DrainRate:
    """Requests dispatched per second for one pool (EWMA over the shared counter)."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        self.half_life_s = half_life_s
        self.rate_per_s = 0.0
        self.num_samples = 0
        self._last: tuple[float, int] | None = None

    def observe(self, now_s: float, num_dispatched_total: int) -> None:
        if self._last is None or num_dispatched_total < self._last[1]:
            self._last = (now_s, num_dispatched_total)  # first look, or the counter was reset
            return
        elapsed = now_s - self._last[0]
        if elapsed < 0.2:
            return
        sample = (num_dispatched_total - self._last[1]) / elapsed
        if self.num_samples == 0:
            self.rate_per_s = sample  # no history to average with: take it as it is
        else:
            weight = 1 - 0.5 ** (elapsed / self.half_life_s)
            self.rate_per_s += weight * (sample - self.rate_per_s)
        self.num_samples += 1
        self._last = (now_s, num_dispatched_total)


class HoldTime:
    """Mean seconds a request holds its slot (EWMA): the engines' speed as this replica saw it."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self.mean_s = 0.0

    def observe(self, held_s: float) -> None:
        self.mean_s = (
            held_s if self.mean_s == 0 else self.mean_s + self.weight * (held_s - self.mean_s)
        )


def engines_rate_per_s(offers: Sequence[EndpointOffer]) -> float:
    """What the engines say they drain: each one's slots over its mean seconds per request."""
    return sum(o.slots_total / o.mean_request_s for o in offers if o.mean_request_s > 0)


def service_rate_per_s(
    drain: DrainRate | None,
    hold: HoldTime | None,
    num_slots_total: int,
    engines_rate: float = 0.0,
) -> float:
    """Requests per second the pool drains when its slots are full.

    Slots divided by the mean time a request holds its slot, as measured: unlike the dispatch
    rate, it does not fall when admission itself holds places back (which would stretch the
    Retry-After, admit less, and measure a lower rate again). Before any request has finished
    here, the shared dispatch counter's rate; before any drain, ``engines_rate`` (what the
    engines report, ``engines_rate_per_s``); 0 when nothing is known yet.
    """
    if hold is not None and hold.mean_s > 0 and num_slots_total > 0:
        return num_slots_total / hold.mean_s
    if drain is not None and drain.num_samples > 0 and drain.rate_per_s > 0:
        return drain.rate_per_s
    return max(0.0, engines_rate)


def promise_gap_us(rate_per_s: float) -> int:
    """Microseconds between two places promised to rejected clients."""
    if not rate_per_s > 0:  # NaN too
        return UNKNOWN_GAP_US
    if not math.isfinite(rate_per_s):
        return 1
    return min(MAX_WAIT_US, max(1, int(1_000_000 / (rate_per_s * PROMISE_SAFETY))))


def wait_gap_us(rate_per_s: float) -> int:
    """Microseconds between two places freeing at ``rate_per_s`` (no safety margin: it predicts
    a queued request's wait); 0 when nothing is known."""
    if not rate_per_s > 0:  # NaN too
        return 0
    if not math.isfinite(rate_per_s):
        return 1
    return min(MAX_WAIT_US, max(1, int(1_000_000 / rate_per_s)))


def queue_drain_seconds(queue_depth: int, rate_per_s: float) -> int:
    """Retry-After for a request that timed out in the queue: the time to drain the queue ahead
    of a new arrival at the measured rate (1 s when nothing is known: try again soon)."""
    if rate_per_s <= 0:
        return 1
    return max(1, math.ceil((queue_depth + 1) / rate_per_s))
