"""A pool's cold start, measured: seconds from an engine pod's creation to its Ready condition.

It is what a request for a pool at zero waits (scheduling, image pull, model load, readiness
probe), and the gateways use it as the Retry-After of such requests when they time out
(``status.coldStartSeconds``). The value kept is the longest of the last ``SAMPLES_KEPT``
measurements: a promise that holds for the slow starts too, and follows a new image or model
within a few pods.

Only pods seen starting are measured: a pod first seen already Ready (the operator restarted)
and a pod that turns Ready again after losing readiness would count the wrong interval, since
Kubernetes keeps only the last transition time. The status value survives an operator restart
as the first sample.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Key = tuple[str, str]  # (namespace, pool name)
SAMPLES_KEPT = 5


def _parse_time(value: object) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _positive_seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def ready_after_seconds(body: Mapping[str, Any]) -> float | None:
    """Seconds from the pod's creation to its Ready condition (None while not Ready)."""
    conditions = (body.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return None
    created = _parse_time((body.get("metadata") or {}).get("creationTimestamp"))
    became_ready = _parse_time(ready.get("lastTransitionTime"))
    if created is None or became_ready is None or became_ready < created:
        return None
    return (became_ready - created).total_seconds()


@dataclass
class _PoolStarts:
    samples: deque[float]
    # Pods of the pool seen so far: "starting" (seen not Ready) or "done" (measured, or first
    # seen Ready: not measurable).
    pods: dict[str, Literal["starting", "done"]] = field(default_factory=dict)


class ColdStarts:
    """Every pool's recent cold starts (kept by the status writer)."""

    def __init__(self) -> None:
        self._pools: dict[Key, _PoolStarts] = {}

    def observe(
        self, key: Key, pods: Iterable[tuple[str, float | None]], previous: object = None
    ) -> float | None:
        """Take in the pool's pods as (name, ready-after seconds or None) and return its cold
        start (seconds, one decimal), or None before any was measured. ``previous``: the value
        in the pool's status, the first sample after a restart."""
        starts = self._pools.get(key)
        if starts is None:
            starts = self._pools[key] = _PoolStarts(deque(maxlen=SAMPLES_KEPT))
            if (seconds := _positive_seconds(previous)) is not None:
                starts.samples.append(seconds)
        current: dict[str, Literal["starting", "done"]] = {}
        for name, ready_after_s in pods:
            seen = starts.pods.get(name)
            if ready_after_s is None:
                current[name] = seen or "starting"
            elif seen == "starting":
                starts.samples.append(ready_after_s)
                current[name] = "done"
            else:
                current[name] = "done"
        starts.pods = current  # pods gone are forgotten: names are never reused
        return round(max(starts.samples), 1) if starts.samples else None

    def forget(self, key: Key) -> None:
        self._pools.pop(key, None)
