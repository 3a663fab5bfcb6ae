"""What the engines say about themselves while the demo runs (their Prometheus ``/metrics``).

Slot utilisation of a phase comes from the engine's own counters (``slotserve_engine_steps`` and
``slotserve_slot_utilisation``, which is useful slot-steps / slot-steps since start), so the demo
reports what the scheduler did rather than a client-side guess. Occupancy over steps comes from
sampling ``vllm:num_requests_running`` next to the step counter a few times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

STEPS = "slotserve_engine_steps_total"
UTILISATION = "slotserve_slot_utilisation"
SLOTS_TOTAL = "slotserve_slots_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class EngineCounters:
    """One scrape of one engine: cumulative counters and current gauges."""

    steps: float
    useful_slot_steps: float
    slots_total: float
    running: float
    waiting: float


@dataclass(frozen=True)
class OccupancySample:
    """Requests holding a slot at a known engine step, seconds after the phase started."""

    engine: str
    t: float
    step: float
    running: float
    waiting: float


def parse_counters(text: str) -> EngineCounters:
    """Pick the numbers the demo needs out of an engine's Prometheus text (summed over labels)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    steps = values.get(STEPS, 0.0)
    slots = values.get(SLOTS_TOTAL, 0.0)
    return EngineCounters(
        steps=steps,
        useful_slot_steps=values.get(UTILISATION, 0.0) * steps * slots,
        slots_total=slots,
        running=values.get(RUNNING, 0.0),
        waiting=values.get(WAITING, 0.0),
    )


async def scrape(client: httpx.AsyncClient, engine_url: str) -> EngineCounters:
    response = await client.get(f"{engine_url}/metrics", timeout=10)
    response.raise_for_status()
    return parse_counters(response.text)


async def scrape_all(engine_urls: list[str]) -> dict[str, EngineCounters]:
    async with httpx.AsyncClient() as client:
        counters = await asyncio.gather(*(scrape(client, url) for url in engine_urls))
    return dict(zip(engine_urls, counters, strict=True))


def phase_utilisation(
    before: dict[str, EngineCounters], after: dict[str, EngineCounters]
) -> float | None:
    """Useful slot-steps / slot-steps over the phase, all engines of the pool together."""
    useful = sum(after[url].useful_slot_steps - before[url].useful_slot_steps for url in after)
    slot_steps = sum(
        (after[url].steps - before[url].steps) * after[url].slots_total for url in after
    )
    return useful / slot_steps if slot_steps > 0 else None


def phase_steps(before: dict[str, EngineCounters], after: dict[str, EngineCounters]) -> int:
    return int(sum(after[url].steps - before[url].steps for url in after))


class OccupancySampler:
    """Polls every engine's /metrics until stopped; the samples become the occupancy plot."""

    def __init__(self, engine_urls: list[str], interval_seconds: float = 0.1) -> None:
        self.engine_urls = engine_urls
        self.interval_seconds = interval_seconds
        self.samples: list[OccupancySample] = []
        self._baseline: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, baseline: dict[str, EngineCounters], t0: float) -> None:
        """Steps are counted from ``baseline`` and times from ``t0`` (``time.monotonic``)."""
        self._baseline = {url: counters.steps for url, counters in baseline.items()}
        self._task = asyncio.create_task(self._run(t0))

    async def stop(self) -> list[OccupancySample]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.samples

    async def _run(self, t0: float) -> None:
        async with httpx.AsyncClient() as client:
            while not self._stop.is_set():
                for url in self.engine_urls:
                    try:
                        counters = await scrape(client, url)
                    except httpx.HTTPError:
                        continue
                    self.samples.append(
                        OccupancySample(
                            engine=url,
                            t=time.monotonic() - t0,
                            step=counters.steps - self._baseline.get(url, 0.0),
                            running=counters.running,
                            waiting=counters.waiting,
                        )
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_seconds)
