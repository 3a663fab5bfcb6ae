"""Reads the pools' admission state from the Redis the gateways share (read-only).

Key names come from ``slotserve.contracts.redis_keys`` and ``slotserve.admission_stats``, the same
definitions the gateway writes with. One read is two round trips for all pools: ``TIME`` (lease
expiries and windows are Redis server time), then one pipeline of ``ZCARD`` (queue), ``ZCOUNT``
(unexpired leases) and ``HGETALL`` of the last minute's windows per pool. Every failure becomes
``AdmissionUnavailableError`` within ``timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, RedisError

from slotserve.admission_stats import summarize, windows_to_read
from slotserve.contracts.redis_keys import Keys
from slotserve.operator.admission import AdmissionReading

NUM_COMMANDS_BEFORE_WINDOWS = 2


class AdmissionUnavailableError(Exception):
    """Redis could not be read; the message says why."""


class AdmissionReader:
    """The operator's read-only view of the gateways' Redis."""

    def __init__(
        self, url: str, *, prefix: str, password: str | None = None, timeout_s: float = 3.0
    ) -> None:
        self.keys = Keys(prefix)
        self.timeout_s = timeout_s
        self.client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(2.0, timeout_s),
            retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
            password=password or None,  # a password in the URL wins either way
        )

    async def read(self, pools: Iterable[str]) -> dict[str, AdmissionReading]:
        """The admission state of each pool (by its model name: the gateways' pool key)."""
        try:
            return await asyncio.wait_for(self._read(sorted(set(pools))), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as error:
            raise AdmissionUnavailableError(str(error) or type(error).__name__) from error

    async def _read(self, pools: list[str]) -> dict[str, AdmissionReading]:
        seconds, micros = await self.client.time()
        now_us = seconds * 1_000_000 + micros
        numbers, covered_s = windows_to_read(now_us / 1e6)
        pipe = self.client.pipeline(transaction=False)
        for pool in pools:
            pipe.zcard(self.keys.pool_key(pool, "queue"))
            pipe.zcount(self.keys.pool_key(pool, "leases"), now_us, "+inf")
            for number in numbers:
                pipe.hgetall(self.keys.window(pool, number))
        replies = await pipe.execute() if pools else []
        per_pool = NUM_COMMANDS_BEFORE_WINDOWS + len(numbers)
        readings: dict[str, AdmissionReading] = {}
        for index, pool in enumerate(pools):
            queued, in_flight, *windows = replies[index * per_pool : (index + 1) * per_pool]
            readings[pool] = AdmissionReading(
                queued=int(queued),
                in_flight=int(in_flight),
                window=summarize(windows, covered_s),
            )
        return readings

    async def close(self) -> None:
        await self.client.aclose()
