"""Engine load reports: every endpoint's ``GET /load``, read continuously.

The slot count the gateway enforces is the engine's own ``slots_total``
(``slotserve.contracts.engine_load``); an endpoint that does
not answer, reports ``draining`` or failed a proxied request is offered to nobody until its next
good report.

Engines are untrusted input: a report longer than ``MAX_LOAD_REPORT_BYTES``, or with values no
engine reports (slots outside 0..1024, a load that is not a finite number, NaN, more than 2,048
prefix keys or one that is not 16 hex digits, more empty rows than a prefix cache holds),
makes the engine broken: offered to nobody for ``BROKEN_HOLD_S``, whatever it reports
meanwhile; so does an answer or stream that breaks the proxy's limits (``mark_broken``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass

import aiohttp

from slotserve.contracts.engine_load import EngineLoadReport
from slotserve.contracts.prefix_keys import deepest_match, is_key
from slotserve.gateway.pools.config import PoolRegistry
from slotserve.gateway.pools.routing import (
    MAX_OFFER_AGE_MS,
    MAX_OFFER_ROWS,
    MAX_ROUTE_DEPTHS,
    EndpointOffer,
    load_score,
)

log = logging.getLogger(__name__)
FAILURES_BEFORE_DOWN = 2
MAX_LOAD_REPORT_BYTES = 64 * 1024  # a report is a few hundred bytes
MAX_REPORTED_SLOTS = 1024  # MaxBatchSize's bound
BROKEN_HOLD_S = 30.0  # how long an engine that broke the gateway's limits is offered to nobody


class BadReportError(ValueError):
    """A /load answer no sound engine sends."""


def _reject_constant(name: str) -> None:
    raise BadReportError(f"{name} is not a JSON number")


def parse_load_report(data: bytes) -> EngineLoadReport:
    """An engine's /load body, checked: raises BadReportError for what no engine sends."""
    if len(data) > MAX_LOAD_REPORT_BYTES:
        raise BadReportError(f"a /load body longer than {MAX_LOAD_REPORT_BYTES} bytes")
    try:
        report = EngineLoadReport.model_validate(json.loads(data, parse_constant=_reject_constant))
    except (ValueError, RecursionError) as exc:
        raise BadReportError(f"a /load body that does not parse: {exc}") from None
    numbers = (report.kv_cache_usage, report.mean_request_seconds)
    if not all(math.isfinite(value) and value >= 0 for value in numbers):
        raise BadReportError("a load that is not a finite number")
    counts = (report.slots_total, report.running, report.waiting)
    if not 0 <= report.slots_total <= MAX_REPORTED_SLOTS or min(counts) < 0:
        raise BadReportError(f"slots_total {report.slots_total} (at most {MAX_REPORTED_SLOTS})")
    if not 0 <= report.prefix_rows_free <= MAX_OFFER_ROWS:
        rows = report.prefix_rows_free
        raise BadReportError(f"prefix_rows_free {rows} (at most {MAX_OFFER_ROWS})")
    if not all(is_key(key) for key in report.prefix_keys):
        raise BadReportError("a prefix key that is not 16 hex digits")
    return report


@dataclass
class EngineLoad:
    """The last report of one endpoint."""

    url: str
    slots_total: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    draining: bool = False
    mean_request_s: float = 0.0
    num_failures: int = FAILURES_BEFORE_DOWN  # unknown until the first good report
    failed_by_proxy: bool = False
    broken_until: float = 0.0  # monotonic: broke the gateway's limits, offered to nobody
    # The prefix keys its slot rows hold (its last report): prefix-aware routing's index.
    prefix_keys: frozenset[str] = frozenset()
    rows_free: int = 0  # KV rows holding nothing yet (its report's prefix_rows_free)
    row_idle_ms: int = 0  # how long its next row to evict has sat unused (prefix_row_idle_ms)
    read_at: float = 0.0  # monotonic: when this replica read the report

    @property
    def usable(self) -> bool:
        return (
            self.num_failures < FAILURES_BEFORE_DOWN
            and not self.failed_by_proxy
            and not self.draining
            and self.slots_total > 0
            and time.monotonic() >= self.broken_until
        )


class EngineMonitor:
    """Polls every endpoint of every pool and offers the usable ones to admission."""

    def __init__(self, registry: PoolRegistry, interval_s: float = 0.25) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.loads: dict[str, EngineLoad] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.first_round = asyncio.Event()
        self.polled_version = -1  # the registry version whose endpoints were all polled

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s * 4))
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run(), name="engine-monitor")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    def offers(self, model: str) -> list[EndpointOffer]:
        pool = self.registry.get(model)
        if pool is None:
            return []
        offers = []
        for url in pool.endpoints:
            load = self.loads.get(url)
            if load is not None and load.usable:
                score = load_score(
                    load.running, load.waiting, load.kv_cache_usage, load.slots_total
                )
                age_ms = int((time.monotonic() - load.read_at) * 1000)
                offers.append(
                    EndpointOffer(
                        url,
                        load.slots_total,
                        score,
                        load.mean_request_s,
                        load.rows_free,
                        load.row_idle_ms,
                        min(max(0, age_ms), MAX_OFFER_AGE_MS),
                    )
                )
        return offers

    def prefix_depths(self, model: str, keys: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
        """(url, keys matched) of the pool's usable engines whose rows hold a prefix of
        ``keys``, deepest first, at most ``MAX_ROUTE_DEPTHS``."""
        pool = self.registry.get(model)
        if pool is None or not keys:
            return ()
        depths = []
        for url in pool.endpoints:
            load = self.loads.get(url)
            if load is not None and load.usable and load.prefix_keys:
                depth = deepest_match(keys, load.prefix_keys)
                if depth:
                    depths.append((url, depth))
        depths.sort(key=lambda pair: (-pair[1], pair[0]))
        return tuple(depths[:MAX_ROUTE_DEPTHS])

    def matched_depth(self, url: str, keys: tuple[str, ...]) -> int:
        """How many leading ``keys`` the rows of ``url`` hold, as it reported last."""
        load = self.loads.get(url)
        return deepest_match(keys, load.prefix_keys) if load is not None else 0

    def index_sizes(self, model: str) -> dict[str, int]:
        """Prefix keys each usable engine of the pool reported last (its index size)."""
        pool = self.registry.get(model)
        urls = pool.endpoints if pool is not None else ()
        return {url: len(self.loads[url].prefix_keys) for url in urls if url in self.loads}

    def mark_broken(self, url: str, hold_s: float = BROKEN_HOLD_S) -> None:
        """``url`` broke the gateway's limits: offer it to nobody for ``hold_s``, whatever it
        reports meanwhile."""
        load = self.loads.get(url)
        if load is not None:
            load.broken_until = time.monotonic() + hold_s

    def mark_failed(self, url: str) -> None:
        """A proxied request could not reach ``url``: offer it to nobody until it reports again."""
        load = self.loads.get(url)
        if load is not None:
            load.failed_by_proxy = True

    async def poll_once(self) -> None:
        version = self.registry.version
        urls = self.registry.endpoints()
        for url in list(self.loads):
            if url not in urls:
                del self.loads[url]
        await asyncio.gather(*(self._poll(url) for url in urls))
        self.polled_version = version
        self.first_round.set()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _poll(self, url: str) -> None:
        assert self._session is not None
        load = self.loads.setdefault(url, EngineLoad(url))
        try:
            async with self._session.get(f"{url}/load") as resp:
                resp.raise_for_status()
                report = parse_load_report(await resp.content.read(MAX_LOAD_REPORT_BYTES + 1))
            load.slots_total = report.slots_total
            load.running = report.running
            load.waiting = report.waiting
            load.kv_cache_usage = report.kv_cache_usage
            load.draining = report.draining
            load.mean_request_s = max(0.0, report.mean_request_seconds)
            load.prefix_keys = frozenset(report.prefix_keys)
            load.rows_free = report.prefix_rows_free
            load.row_idle_ms = report.prefix_row_idle_ms
            load.read_at = time.monotonic()
        except BadReportError as exc:
            if time.monotonic() >= load.broken_until:
                log.warning("engine %s is broken: %s; marked down", url, exc)
            load.broken_until = time.monotonic() + BROKEN_HOLD_S
            load.num_failures = max(load.num_failures + 1, FAILURES_BEFORE_DOWN)
            return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            load.num_failures += 1
            if load.num_failures == FAILURES_BEFORE_DOWN:
                log.warning("engine %s is down: %s", url, exc or type(exc).__name__)
            return
        if load.num_failures >= FAILURES_BEFORE_DOWN:
            log.info("engine %s is up: %d slots", url, load.slots_total)
        load.num_failures = 0
        load.failed_by_proxy = False
