"""Admission statistics shared through Redis: what the gateway records, what the operator reads.

The gateway's replicas already share each pool's queue and slot leases in Redis
(``contracts.redis_keys``). For the pool's ``status.admission`` the operator also needs rates
and queue waits over the last minute, summed over every gateway replica. Each replica adds its
counts to one small hash per pool and 10-second window (``Keys.window``), every second, with
``HINCRBY`` + ``EXPIRE`` in one ``MULTI``/``EXEC`` (atomic; the hash tag keeps it in one cluster
slot). Fields:

| field | meaning |
|---|---|
| ``admitted`` | requests given a slot |
| ``rejected:<reason>`` | requests refused (``queue_full``, ``queue_timeout``, ...) |
| ``wait:<i>`` | admitted requests that waited within ``WAIT_BUCKETS_S[i]`` (last: longer) |
| ``tenant:<name>:admitted``, ``tenant:<name>:wait:<i>`` | the same, for one tenant |
| ``prefix:routed``, ``prefix:hit`` | admitted with prefix keys; of those, sent to a cached prefix |

A window lives ``WINDOW_TTL_S``, so a pool nobody calls leaves nothing behind. Windows are
numbered by wall-clock time (``unix seconds // WINDOW_SECONDS``): replicas' clocks only need to
agree to within a fraction of a window. Everything here is pure except ``record``/``read``'s
Redis calls, which the gateway and the operator make with their own clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

WINDOW_SECONDS = 10
NUM_WINDOWS = 6  # one minute of complete windows, plus the current one
WINDOW_TTL_S = WINDOW_SECONDS * (NUM_WINDOWS + 3)
# Upper bounds (seconds) of the queue-wait buckets: the gateway's Prometheus histogram's.
WAIT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120
)  # fmt: skip
ADMITTED = "admitted"
REJECTED_PREFIX = "rejected:"
WAIT_PREFIX = "wait:"
PREFIX_ROUTED, PREFIX_HIT = "prefix:routed", "prefix:hit"
TENANT_PREFIX = "tenant:"  # tenant names (tenants.TENANT_NAME) hold no ':'
# status.admission.tenants lists at most this many tenants, the most admitted first (the rest are
# in the pool's totals): a status object stays small however many tenants a keys file declares.
MAX_TENANTS_IN_STATUS = 16


def window_of(unix_s: float) -> int:
    """The number of the window that contains ``unix_s``."""
    return int(unix_s // WINDOW_SECONDS)


def wait_bucket(wait_s: float) -> int:
    """Index of the first bucket whose upper bound holds ``wait_s`` (len = above all)."""
    for index, bound in enumerate(WAIT_BUCKETS_S):
        if wait_s <= bound:
            return index
    return len(WAIT_BUCKETS_S)


@dataclass
class WindowCounts:
    """Counts one gateway replica has not written yet, per pool (hash field -> increment)."""

    fields: dict[str, dict[str, int]] = field(default_factory=dict)

    def admitted(self, pool: str, wait_s: float, tenant: str | None = None) -> None:
        counts = self.fields.setdefault(pool, {})
        bucket = f"{WAIT_PREFIX}{wait_bucket(wait_s)}"
        prefixes = ("",) if tenant is None else ("", f"{TENANT_PREFIX}{tenant}:")
        for prefix in prefixes:
            for name in (f"{prefix}{ADMITTED}", f"{prefix}{bucket}"):
                counts[name] = counts.get(name, 0) + 1

    def rejected(self, pool: str, reason: str) -> None:
        counts = self.fields.setdefault(pool, {})
        name = f"{REJECTED_PREFIX}{reason}"
        counts[name] = counts.get(name, 0) + 1

    def prefix_routed(self, pool: str, *, hit: bool) -> None:
        counts = self.fields.setdefault(pool, {})
        for name in (PREFIX_ROUTED, PREFIX_HIT) if hit else (PREFIX_ROUTED,):
            counts[name] = counts.get(name, 0) + 1

    def take(self) -> dict[str, dict[str, int]]:
        taken, self.fields = self.fields, {}
        return taken

    def put_back(self, taken: Mapping[str, Mapping[str, int]]) -> None:
        """Counts a failed write did not store: added to the next one."""
        for pool, counts in taken.items():
            mine = self.fields.setdefault(pool, {})
            for name, value in counts.items():
                mine[name] = mine.get(name, 0) + value


@dataclass(frozen=True)
class TenantSummary:
    """One tenant's last minute in a pool."""

    admitted_per_minute: int
    queue_wait_p95_s: float | None


@dataclass(frozen=True)
class WindowSummary:
    """One pool's last minute, summed over every gateway replica."""

    admitted_per_minute: int
    rejected_per_minute: dict[str, int]
    queue_wait_p95_s: float | None  # None: nothing admitted in the window
    # Rejections in the current and the previous window only (10-20 s): demand right now, for
    # the autoscaler (a minute's rejections would hold a pool up long after they stopped).
    recent_rejected: dict[str, int] = field(default_factory=dict)
    # The most admitted tenants' own rates and waits (MAX_TENANTS_IN_STATUS of them).
    tenants: dict[str, TenantSummary] = field(default_factory=dict)
    # Of the requests routed with prefix keys, the share sent to an engine holding a prefix of
    # them (None: none routed with keys in the window).
    prefix_hit_ratio: float | None = None


def summarize(windows: Sequence[Mapping[str, str]], covered_s: float) -> WindowSummary:
    """Rates per minute and the queue-wait p95 from the hashes of the windows read.

    ``covered_s`` is the time those windows span (the complete ones plus the elapsed part of
    the current one), so counts scale to a minute whatever the moment of the read.
    """
    totals: dict[str, int] = {}
    for window in windows:
        for name, value in window.items():
            totals[name] = totals.get(name, 0) + int(value)
    scale = 60.0 / max(covered_s, 1.0)
    rejected = {
        name.removeprefix(REJECTED_PREFIX): round(count * scale)
        for name, count in sorted(totals.items())
        if name.startswith(REJECTED_PREFIX) and count > 0
    }
    waits = [totals.get(f"{WAIT_PREFIX}{i}", 0) for i in range(len(WAIT_BUCKETS_S) + 1)]
    recent: dict[str, int] = {}
    for window in windows[-2:]:  # the reader passes the current window last
        for name, value in window.items():
            if name.startswith(REJECTED_PREFIX):
                reason = name.removeprefix(REJECTED_PREFIX)
                recent[reason] = recent.get(reason, 0) + int(value)
    return WindowSummary(
        admitted_per_minute=round(totals.get(ADMITTED, 0) * scale),
        rejected_per_minute=rejected,
        queue_wait_p95_s=quantile(waits, 0.95),
        recent_rejected=recent,
        tenants=_tenants(totals, scale),
        prefix_hit_ratio=(
            totals.get(PREFIX_HIT, 0) / totals[PREFIX_ROUTED] if totals.get(PREFIX_ROUTED) else None
        ),
    )


def _tenants(totals: Mapping[str, int], scale: float) -> dict[str, TenantSummary]:
    admitted = {
        name.removeprefix(TENANT_PREFIX).rsplit(":", 1)[0]: count
        for name, count in totals.items()
        if name.startswith(TENANT_PREFIX) and name.endswith(f":{ADMITTED}") and count > 0
    }
    most = sorted(admitted, key=lambda tenant: (-admitted[tenant], tenant))
    out = {}
    for tenant in most[:MAX_TENANTS_IN_STATUS]:
        prefix = f"{TENANT_PREFIX}{tenant}:{WAIT_PREFIX}"
        waits = [totals.get(f"{prefix}{i}", 0) for i in range(len(WAIT_BUCKETS_S) + 1)]
        out[tenant] = TenantSummary(round(admitted[tenant] * scale), quantile(waits, 0.95))
    return out


def quantile(bucket_counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile of bucketed waits, interpolated inside its bucket as Prometheus'
    ``histogram_quantile`` does; waits above the last bound report that bound."""
    total = sum(bucket_counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(bucket_counts):
        if count and below + count >= rank:
            if index == len(WAIT_BUCKETS_S):
                return WAIT_BUCKETS_S[-1]
            lower = WAIT_BUCKETS_S[index - 1] if index else 0.0
            upper = WAIT_BUCKETS_S[index]
            return lower + (upper - lower) * (rank - below) / count
        below += count
    return WAIT_BUCKETS_S[-1]


def windows_to_read(now_unix_s: float) -> tuple[list[int], float]:
    """The windows a reader sums (the current one last) and the seconds they span."""
    current = window_of(now_unix_s)
    elapsed = now_unix_s - current * WINDOW_SECONDS
    numbers = list(range(current - NUM_WINDOWS, current + 1))
    return numbers, NUM_WINDOWS * WINDOW_SECONDS + elapsed
