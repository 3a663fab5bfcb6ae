"""A delayed work queue of pools to converge again: drift repair, retries with backoff, resync.

kopf retries the pool handlers (create/update/resume) with ``TemporaryError``, but a child
changed or deleted by hand produces an event on the child, whose handler kopf never retries, and
kopf's timers would put a finalizer on every pool (a pool then cannot be deleted while the
operator is down). So drift goes through this queue, the way controller-runtime's rate-limited
work queue does it: the child's event handler enqueues the pool; one worker converges it (one
pool at a time); a failure comes back after an exponential backoff; every pool is enqueued
again every ``resync_seconds`` (to repair what a missed watch event hid). One key is queued at
most once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K")
log = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 60.0


def backoff_seconds(attempt: int) -> float:
    """Delay before retry number ``attempt`` (1, 2, ...): 0.5 s doubling up to 60 s."""
    return min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2 ** (attempt - 1))


class Healer(Generic[K]):
    """Awaits ``work(key)`` for each enqueued key; False means "retry later"."""

    def __init__(
        self,
        work: Callable[[K], Awaitable[bool]],
        *,
        resync_seconds: float,
        keys: Callable[[], Iterable[K]],
    ) -> None:
        self._work = work
        self._keys = keys
        self._resync_seconds = resync_seconds
        self._due: dict[K, float] = {}
        self._attempts: dict[K, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the worker and the resync on the running loop (kopf's)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._worker(), name="slotserve-healer"),
            asyncio.create_task(self._resync(), name="slotserve-resync"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def enqueue(self, key: K, delay: float = 0.0) -> None:
        """Converge ``key`` after ``delay`` seconds (ignored before ``start``)."""
        if self._loop is None:
            return
        self._schedule(key, delay)

    def _schedule(self, key: K, delay: float) -> None:
        assert self._loop is not None and self._wake is not None
        due = self._loop.time() + delay
        self._due[key] = min(due, self._due.get(key, due))
        self._wake.set()

    async def _worker(self) -> None:
        assert self._loop is not None and self._wake is not None
        while True:
            now = self._loop.time()
            ready = [key for key, due in self._due.items() if due <= now]
            if not ready:
                self._wake.clear()
                timeout = min(self._due.values(), default=now + 3600) - now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                continue
            for key in ready:
                del self._due[key]
                try:
                    done = await self._work(key)
                except Exception:  # a bug must not stop the healing of every other pool
                    log.exception("converging %s failed", key)
                    done = False
                if done:
                    self._attempts.pop(key, None)
                else:
                    attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
                    self._schedule(key, backoff_seconds(attempt))

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self._resync_seconds)
            for key in list(self._keys()):
                self._schedule(key, 0.0)
