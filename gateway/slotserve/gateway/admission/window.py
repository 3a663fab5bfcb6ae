"""Writes this replica's admission counts to Redis once a second, for the operator's status.

Counting happens in memory on the request path (no Redis call per request); a flush task adds
the counts to the pool's current window hash (``slotserve.admission_stats``) with one atomic
``MULTI``/``EXEC`` per pool: ``HINCRBY`` per field, then ``EXPIRE``. A failed flush keeps its
counts for the next one; statistics never fail or slow a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from slotserve.admission_stats import WINDOW_TTL_S, WindowCounts, window_of
from slotserve.contracts.redis_keys import Keys

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 1.0
FLUSH_TIMEOUT_S = 3.0


class AdmissionWindowWriter:
    """One gateway replica's admission counts, flushed to Redis every ``interval_s``."""

    def __init__(
        self, client: aioredis.Redis, prefix: str, interval_s: float = FLUSH_INTERVAL_S
    ) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.interval_s = interval_s
        self.counts = WindowCounts()
        self._task: asyncio.Task[None] | None = None

    def admitted(self, pool: str, wait_s: float, tenant: str | None = None) -> None:
        self.counts.admitted(pool, wait_s, tenant)

    def rejected(self, pool: str, reason: str) -> None:
        self.counts.rejected(pool, reason)

    def prefix_routed(self, pool: str, *, hit: bool) -> None:
        self.counts.prefix_routed(pool, hit=hit)

    async def flush(self) -> None:
        taken = self.counts.take()
        if not taken:
            return
        number = window_of(time.time())
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                for pool, fields in taken.items():
                    key = self.keys.window(pool, number)
                    for name, value in fields.items():
                        pipe.hincrby(key, name, value)
                    pipe.expire(key, WINDOW_TTL_S)
                await asyncio.wait_for(pipe.execute(), FLUSH_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("admission window flush failed (kept for the next one): %s", exc)
            self.counts.put_back(taken)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="admission-window-writer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(), FLUSH_TIMEOUT_S)  # the last second's counts
        with contextlib.suppress(Exception):
            await self.client.aclose()
