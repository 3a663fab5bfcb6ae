"""The loop that keeps every pool's ``status.admission`` and ``Saturated`` condition current.

Every ``refresh_s`` it reads all pools from Redis at once (``AdmissionReader``), and hands a
pool to ``publish`` only when its numbers moved beyond the thresholds of
``admission.worth_writing`` or its ``Saturated`` status/reason changed. A Redis that cannot be
read leaves ``status.admission`` as it was (stale: see ``observedTime``) and turns Saturated
``Unknown``; it never touches the children, which the handlers keep reconciling. Readings also
go to ``on_reading`` (the built-in autoscaler), unthrottled.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slotserve.operator.admission import (
    AdmissionReading,
    Saturation,
    admission_status,
    saturation_of,
    unavailable,
    worth_writing,
)
from slotserve.operator.admission_redis import AdmissionReader, AdmissionUnavailableError

log = logging.getLogger(__name__)
Key = tuple[str, str]


@dataclass(frozen=True)
class Target:
    """A pool the monitor observes: its key, the model name the gateways queue it under, and
    the slots of its ready engines."""

    key: Key
    model: str
    slots_total: int


@dataclass
class _Published:
    admission: dict[str, Any] | None
    written_at: float
    saturation: Saturation


Publish = Callable[[Target, dict[str, Any] | None, Saturation, Saturation | None], Awaitable[None]]
OnReading = Callable[[Target, AdmissionReading | None], Awaitable[None]]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class AdmissionMonitor:
    """Reads Redis every ``refresh_s``; publishes what is worth a status write."""

    def __init__(
        self,
        reader: AdmissionReader,
        *,
        refresh_s: float,
        max_age_s: float,
        targets: Callable[[], list[Target]],
        publish: Publish,
        on_reading: OnReading | None = None,
    ) -> None:
        self.reader = reader
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self._targets = targets
        self._publish = publish
        self._on_reading = on_reading
        self._published: dict[Key, _Published] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="slotserve-admission-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.close()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:  # a bug must not end the monitoring of every pool
                log.exception("admission refresh failed")
            await asyncio.sleep(max(0.0, self.refresh_s - (time.monotonic() - started)))

    async def tick(self) -> None:
        """One refresh of every pool."""
        targets = self._targets()
        known = {target.key for target in targets}
        for key in list(self._published):
            if key not in known:
                del self._published[key]
        if not targets:
            return
        try:
            readings: dict[str, AdmissionReading] = await self.reader.read(
                target.model for target in targets
            )
            error = ""
        except AdmissionUnavailableError as exc:
            readings, error = {}, str(exc)
            log.warning("admission state unavailable: %s", error)
        now, now_s = _now(), time.monotonic()
        for target in targets:
            reading = readings.get(target.model)
            if self._on_reading is not None:
                await self._on_reading(target, reading)
            await self._observe(target, reading, error, now, now_s)

    async def _observe(
        self, target: Target, reading: AdmissionReading | None, error: str, now: str, now_s: float
    ) -> None:
        before = self._published.get(target.key)
        if reading is None:
            saturation, admission = unavailable(error or "no reading"), None
        else:
            saturation = saturation_of(reading, target.slots_total)
            admission = admission_status(reading, target.slots_total, now)
        written = before.admission if before is not None else None
        # After an outage the numbers are rewritten at once: their observedTime is old news.
        fresh = before is not None and before.saturation.status != "Unknown"
        age_s = now_s - before.written_at if fresh and before is not None else float("inf")
        write_admission = admission is not None and worth_writing(
            written, admission, age_s=age_s, max_age_s=self.max_age_s
        )
        previous_saturation = before.saturation if before is not None else None
        flipped = previous_saturation is None or (
            (previous_saturation.status, previous_saturation.reason)
            != (saturation.status, saturation.reason)
        )
        if not (write_admission or flipped):
            return
        await self._publish(
            target, admission if write_admission else None, saturation, previous_saturation
        )
        self._published[target.key] = _Published(
            admission=admission if write_admission else written,
            written_at=now_s if write_admission else (before.written_at if before else now_s),
            saturation=saturation,
        )
