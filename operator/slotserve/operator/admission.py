"""Pure admission status: a pool's ``status.admission`` and ``Saturated`` condition from one
Redis read, and the rule that decides when it is worth a status write.

The operator reads Redis every ``admission_refresh_seconds``, but writes the pool's status only
when what a user sees moved beyond a threshold (``worth_writing``), or when the last write is
``max_age_s`` old (so ``observedTime`` says the numbers are current). Writes per pool are thus
at most one per refresh, and under steady load about one per ``max_age_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotserve.admission_stats import WindowSummary

# Counts (queued, inFlight) are worth a write when they change by this much...
COUNT_ABSOLUTE = 2
COUNT_RELATIVE = 0.1
# ...rates by this much (per minute)...
RATE_ABSOLUTE = 5
RATE_RELATIVE = 0.1
# ...and the queue-wait p95 by this much (seconds).
WAIT_ABSOLUTE_S = 0.05
WAIT_RELATIVE = 0.2


@dataclass(frozen=True)
class AdmissionReading:
    """One pool's admission state as read from Redis."""

    queued: int
    in_flight: int
    window: WindowSummary


@dataclass(frozen=True)
class Saturation:
    """The ``Saturated`` condition: status True/False/Unknown, with a reason and a message."""

    status: str
    reason: str
    message: str


def saturation_of(reading: AdmissionReading, slots_total: int) -> Saturation:
    """Saturated = requests wait with every slot taken (or no engine), or the queue was full."""
    queue_full = reading.window.rejected_per_minute.get("queue_full", 0)
    if queue_full > 0:
        return Saturation(
            "True", "QueueFull", f"{queue_full} requests/min refused with a full queue"
        )
    if reading.queued > 0 and slots_total == 0:
        return Saturation("True", "NoCapacity", f"{reading.queued} queued, no ready engine")
    if reading.queued > 0 and reading.in_flight >= slots_total:
        return Saturation(
            "True",
            "SlotsFull",
            f"{reading.queued} queued, {reading.in_flight}/{slots_total} slots busy",
        )
    return Saturation(
        "False", "HasCapacity", f"{reading.in_flight}/{slots_total} slots busy, none waiting"
    )


UNAVAILABLE_REASON = "AdmissionUnavailable"


def unavailable(detail: str) -> Saturation:
    """Redis cannot be read: status.admission stays as last seen (stale), the condition says so."""
    return Saturation(
        "Unknown", UNAVAILABLE_REASON, f"cannot read admission state from Redis: {detail}"
    )


def admission_status(reading: AdmissionReading, slots_total: int, now: str) -> dict[str, Any]:
    """``status.admission`` (camelCase) for one reading."""
    status: dict[str, Any] = {
        "queued": reading.queued,
        "inFlight": reading.in_flight,
        "slotsTotal": slots_total,
        "admittedPerMinute": reading.window.admitted_per_minute,
        "rejectedPerMinute": dict(reading.window.rejected_per_minute),
        "saturated": saturation_of(reading, slots_total).status == "True",
        "observedTime": now,
    }
    if reading.window.queue_wait_p95_s is not None:
        status["queueWaitSecondsP95"] = round(reading.window.queue_wait_p95_s, 3)
    if reading.window.prefix_hit_ratio is not None:
        status["prefixHitRatio"] = round(reading.window.prefix_hit_ratio, 3)
    if reading.window.tenants:
        status["tenants"] = {
            name: {"admittedPerMinute": tenant.admitted_per_minute}
            | (
                {}
                if tenant.queue_wait_p95_s is None
                else {"queueWaitSecondsP95": round(tenant.queue_wait_p95_s, 3)}
            )
            for name, tenant in reading.window.tenants.items()
        }
    return status


def _moved(before: float, after: float, absolute: float, relative: float) -> bool:
    if before == after:
        return False
    if before == 0 or after == 0:  # demand appearing or going is always news (scaling)
        return True
    return abs(after - before) >= max(absolute, relative * max(before, after))


def worth_writing(
    written: dict[str, Any] | None, new: dict[str, Any], *, age_s: float, max_age_s: float
) -> bool:
    """Whether ``new`` differs enough from the ``written`` status.admission to write it."""
    if written is None or age_s >= max_age_s:
        return True
    if written.get("saturated") != new["saturated"]:
        return True
    if written.get("slotsTotal") != new["slotsTotal"]:
        return True
    # A tenant appearing or going is news; its own numbers move with the pool's (or max age).
    if set(written.get("tenants", {})) != set(new.get("tenants", {})):
        return True
    for name in ("queued", "inFlight"):
        if _moved(written.get(name, 0), new[name], COUNT_ABSOLUTE, COUNT_RELATIVE):
            return True
    old_rates = {"": written.get("admittedPerMinute", 0), **written.get("rejectedPerMinute", {})}
    new_rates = {"": new["admittedPerMinute"], **new["rejectedPerMinute"]}
    for reason in old_rates.keys() | new_rates.keys():
        before, after = old_rates.get(reason, 0), new_rates.get(reason, 0)
        if _moved(before, after, RATE_ABSOLUTE, RATE_RELATIVE):
            return True
    before_wait, after_wait = written.get("queueWaitSecondsP95"), new.get("queueWaitSecondsP95")
    if (before_wait is None) != (after_wait is None):
        return True
    return (
        before_wait is not None
        and after_wait is not None
        and _moved(before_wait, after_wait, WAIT_ABSOLUTE_S, WAIT_RELATIVE)
    )


def saturated_condition(
    saturation: Saturation, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """The ``Saturated`` condition; lastTransitionTime moves only when its status flips."""
    before = previous or {}
    same = before.get("status") == saturation.status
    changed_at = before.get("lastTransitionTime") if same else None
    return {
        "type": "Saturated",
        "status": saturation.status,
        "reason": saturation.reason,
        "message": saturation.message,
        "lastTransitionTime": changed_at or now,
    }
