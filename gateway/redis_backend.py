"""Redis admission backend: shared queues and slot leases for many gateway replicas.

Every state change is one named Lua script (``gateway/lua.py``), loaded once per server with
SCRIPT LOAD and then called by SHA (redis-py reloads them by itself after a Redis restart).
Grants made by another replica arrive on this replica's grant list, read with BLPOP, so waiting
requests never poll Redis. Connection failures become ``BackendUnavailableError`` at once (no
client-side retry loop), which the HTTP layer answers with 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, NoScriptError, TimeoutError

from slotserve.gateway.admission_types import (
    BackendUnavailableError,
    CancelOutcome,
    DispatchResult,
    Grant,
    GrantCallback,
    PoolPolicy,
    QueueFullError,
)
from slotserve.gateway.keys import GRANT_SEPARATOR, STATE_TTL_S, Keys
from slotserve.gateway.lua import SCRIPTS
from slotserve.gateway.routing import EndpointOffer

log = logging.getLogger(__name__)
_UNAVAILABLE = (ConnectionError, TimeoutError, BusyLoadingError, OSError)


def make_client(url: str, *, socket_timeout_s: float = 3.0) -> aioredis.Redis:
    """A client that fails fast: short timeouts, one immediate retry on a broken connection
    (stale after a Redis restart) and none on timeouts, so a hung Redis costs one timeout."""
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=2.0,
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
    )


def _unavailable(exc: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(f"admission backend (Redis) unavailable: {exc}")


@dataclass
class _Call:
    name: str
    keys: list[str]
    args: list[str | int]
    future: asyncio.Future[list[object]]


@dataclass
class _ReleaseBatch:
    pool: PoolPolicy
    offers: Sequence[EndpointOffer]
    request_ids: list[str] = field(default_factory=list)
    futures: list[asyncio.Future[DispatchResult]] = field(default_factory=list)


class RedisBackend:
    """One replica's connection to the shared admission state in Redis."""

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        prefix: str = "slotserve",
        lease_ttl_s: float = 10.0,
        max_connections: int = 32,
    ) -> None:
        self.replica_id = replica_id
        self.keys = Keys(prefix)
        self.lease_ttl_us = int(lease_ttl_s * 1_000_000)
        self.client = make_client(url)
        # BLPOP holds its connection for up to a second: give it its own client.
        self.blocking_client = make_client(url, socket_timeout_s=5.0)
        # Heartbeats must not queue behind request traffic for a connection: their own client.
        self.control_client = make_client(url)
        # A burst of requests shares a bounded set of connections (FIFO) instead of opening
        # hundreds at once, which on a busy host time out while connecting.
        self._connection_slots = asyncio.Semaphore(max_connections)
        self.scripts = {name: self.client.register_script(src) for name, src in SCRIPTS.items()}
        self._listener: asyncio.Task[None] | None = None
        self._on_grant: GrantCallback | None = None
        self._closing = False
        self._release_batches: dict[str, _ReleaseBatch] = {}
        self._flushes: set[asyncio.Task[None]] = set()
        self._pending: list[_Call] = []

    async def start(self, on_grant: GrantCallback) -> None:
        self._on_grant = on_grant
        with contextlib.suppress(BackendUnavailableError):
            await self.heartbeat({}, restore=False)  # registers this replica as alive
        self._listener = asyncio.create_task(self._listen(), name="redis-grant-listener")

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait([self._listener], timeout=2)
        with contextlib.suppress(*_UNAVAILABLE):
            await self.client.delete(self.keys.replica(self.replica_id))
        for client in (self.client, self.blocking_client, self.control_client):
            await client.aclose()

    # -- script calls -------------------------------------------------------------------------

    def _args(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> list[str | int]:
        args: list[str | int] = [
            self.keys.prefix,
            pool.name,
            self.replica_id,
            self.lease_ttl_us,
            STATE_TTL_S * 1000,
            pool.policy,
            pool.max_queue_delay_us,
            ",".join(str(size) for size in pool.preferred_batch_sizes),
            len(offers),
        ]
        for offer in offers:
            args += [offer.url, offer.slots_total, repr(float(offer.load_score))]
        return args

    async def _run(
        self,
        name: str,
        pool: PoolPolicy,
        args: list[str | int],
        client: aioredis.Redis | None = None,
    ) -> list[object]:
        """Run a named script. Calls made in the same event-loop turn share one pipeline (one
        round trip); each script is still atomic on its own."""
        if client is not None:
            try:
                reply = await self.scripts[name](
                    keys=self.keys.pool(pool.name), args=args, client=client
                )
            except _UNAVAILABLE as exc:
                raise _unavailable(exc) from exc
            return list(reply)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[object]] = loop.create_future()
        self._pending.append(_Call(name, self.keys.pool(pool.name), args, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush_calls)
        return await asyncio.shield(future)

    def _flush_calls(self) -> None:
        calls, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._execute(calls))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _execute(self, calls: list[_Call]) -> None:
        try:
            async with self._connection_slots:
                replies = await self._pipeline(calls)
                missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                if missing:  # Redis restarted (or flushed its scripts): load them, run again
                    for script in self.scripts.values():
                        await self.client.script_load(script.script)
                    again = await self._pipeline([calls[i] for i in missing])
                    for i, reply in zip(missing, again, strict=True):
                        replies[i] = reply
        except _UNAVAILABLE as exc:
            error = _unavailable(exc)
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(error)
            return
        for call, reply in zip(calls, replies, strict=True):
            if call.future.done():
                continue
            if isinstance(reply, Exception):
                call.future.set_exception(reply)
            else:
                call.future.set_result(list(reply))

    async def _pipeline(self, calls: list[_Call]) -> list[object]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(self.scripts[call.name].sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    @staticmethod
    def _result(reply: list[object]) -> DispatchResult:
        grants = [Grant(str(reply[i]), str(reply[i + 1])) for i in range(4, len(reply) - 1, 2)]
        return DispatchResult(grants, int(reply[1]), int(reply[2]), int(reply[3]))  # type: ignore[call-overload]

    async def enqueue(
        self,
        pool: PoolPolicy,
        offers: Sequence[EndpointOffer],
        request_id: str,
        priority: int,
        timeout_us: int,
        *,
        only_if_absent: bool = False,
    ) -> DispatchResult:
        args = [*self._args(pool, offers), request_id, priority, timeout_us, pool.max_queue_size]
        args.append(1 if only_if_absent else 0)
        reply = await self._run("enqueue", pool, args)
        result = self._result(reply)
        if reply[0] == "full":
            raise QueueFullError(
                f"queue of pool {pool.name!r} is full ({pool.max_queue_size} waiting)",
                queue_depth=result.queue_depth,
                num_dispatched_total=result.num_dispatched_total,
            )
        return result

    async def release(
        self, pool: PoolPolicy, offers: Sequence[EndpointOffer], request_id: str
    ) -> DispatchResult:
        """Releases made in the same event-loop turn go to Redis as one script call."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[DispatchResult] = loop.create_future()
        batch = self._release_batches.get(pool.name)
        if batch is None:
            batch = self._release_batches[pool.name] = _ReleaseBatch(pool, offers)
            loop.call_soon(self._flush_releases, pool.name)
        batch.request_ids.append(request_id)
        batch.futures.append(future)
        return await asyncio.shield(future)

    def _flush_releases(self, pool_name: str) -> None:
        batch = self._release_batches.pop(pool_name)
        task = asyncio.get_running_loop().create_task(self._release_batch(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _release_batch(self, batch: _ReleaseBatch) -> None:
        args = [*self._args(batch.pool, batch.offers), *batch.request_ids]
        try:
            result = self._result(await self._run("release", batch.pool, args))
        except BackendUnavailableError as exc:
            for future in batch.futures:
                if not future.done():
                    future.set_exception(exc)
            return
        # The grants go to one caller only; the others learn the queue state.
        rest = DispatchResult([], result.queue_depth, result.num_dispatched_total, result.hold_us)
        for i, future in enumerate(batch.futures):
            if not future.done():
                future.set_result(result if i == 0 else rest)

    async def cancel(self, pool: PoolPolicy, request_id: str) -> CancelOutcome:
        reply = await self._run("cancel", pool, [*self._args(pool, []), request_id])
        return CancelOutcome(str(reply[0]), str(reply[1]))  # type: ignore[arg-type]

    async def tick(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> DispatchResult:
        return self._result(await self._run("tick", pool, self._args(pool, offers)))

    async def heartbeat(self, leases: dict[str, list[tuple[str, str]]], *, restore: bool) -> bool:
        try:
            previous = await self.control_client.set(
                self.keys.replica(self.replica_id), "1", px=self.lease_ttl_us // 1000, get=True
            )
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        for pool_name, held in leases.items():
            pool = PoolPolicy(name=pool_name)
            args = [*self._args(pool, []), "1" if restore else "0"]
            for request_id, endpoint in held:
                args += [request_id, endpoint]
            await self._run("heartbeat", pool, args, client=self.control_client)
        return previous is not None

    async def inflight(self, pool: PoolPolicy) -> dict[str, int]:
        try:
            raw = await self.client.hgetall(self.keys.pool_key(pool.name, "inflight"))
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return {endpoint: int(count) for endpoint, count in raw.items()}

    # -- wake-ups -----------------------------------------------------------------------------

    async def _listen(self) -> None:
        key = self.keys.grants(self.replica_id)
        while not self._closing:
            try:
                popped = await self.blocking_client.blpop([key], timeout=1)
                if popped is None:
                    continue
                items = [popped[1]]
                more = await self.blocking_client.lpop(key, 256)
                items += more or []
            except _UNAVAILABLE:
                await asyncio.sleep(0.25)
                continue
            for item in items:
                pool_name, request_id, endpoint = item.split(GRANT_SEPARATOR)
                if self._on_grant is not None:
                    self._on_grant(pool_name, request_id, endpoint)
