"""Redis admission backend: shared queues and slot leases for many gateway replicas.

Every state change is one named Lua script (``lua/scripts.py``), loaded once per server with
SCRIPT LOAD and then called by SHA (reloaded after a restart or SCRIPT FLUSH). Grants made by
another replica arrive on this replica's grant list, read with BLPOP, so waiting requests never
poll Redis. Every Redis failure (connection, timeout, OOM, READONLY, script errors) becomes
``BackendUnavailableError`` at once (no client-side retry loop), which the HTTP layer answers
with 503 + Retry-After; every await on Redis is bounded by ``CALL_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError, NoScriptError, RedisError

from slotserve.contracts.redis_keys import (
    GRANT_SEPARATOR,
    STATE_TTL_S,
    DispatchArgs,
    Keys,
    ScriptArgs,
)
from slotserve.gateway.admission.lua.args import (
    CancelArgs,
    EnqueueArgs,
    HeartbeatArgs,
    ReleaseArgs,
    TickArgs,
    heartbeat_leases,
)
from slotserve.gateway.admission.lua.replies import (
    DispatchReply,
    HeartbeatReply,
    cancel_outcome,
    dispatch_grants,
    invalid_name,
    is_invalid,
)
from slotserve.gateway.admission.lua.scripts import SCRIPTS
from slotserve.gateway.admission.tenants import DEFAULT_TENANT
from slotserve.gateway.admission.types import (
    DEFAULT_AGING_US,
    BackendUnavailableError,
    CancelOutcome,
    DeadlineUnreachableError,
    DispatchResult,
    GrantCallback,
    InvalidAdmissionValueError,
    NoEngineFitsError,
    PoolPolicy,
    QueueFullError,
    check_enqueue,
    promise_horizon_us,
)
from slotserve.gateway.pools.routing import (
    EndpointOffer,
    Route,
    most_slots,
    sendable_route,
    sound_offers,
)

log = logging.getLogger(__name__)
# Anything Redis or the socket can raise; asyncio's TimeoutError is the builtin one.
_UNAVAILABLE = (RedisError, OSError, TimeoutError)
# The longest any caller waits for one Redis step (socket timeouts are shorter; this also
# bounds the wait for a free connection under a burst).
CALL_TIMEOUT_S = 4.0
DISPATCHING_SCRIPTS = frozenset({"enqueue", "release", "tick"})  # replies carry grants
SWEEP_BATCH = 100  # entries one script may sweep: a few ms of Redis time at most
# Where the pool's name sits in a dispatching script's arguments (its grants go to that pool).
_POOL_ARG = [field.name for field in fields(DispatchArgs)].index("pool")


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


def _text(reply: bytes | str) -> str:
    # The clients decode replies (decode_responses), which redis-py's types cannot express.
    return reply.decode() if isinstance(reply, bytes) else reply


def _unavailable(exc: BaseException) -> BackendUnavailableError:
    detail = str(exc) or type(exc).__name__
    return BackendUnavailableError(f"admission backend (Redis) unavailable: {detail}")


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
        # The admission epoch this replica's leases are written under ("" before the first
        # heartbeat); a script that reports another one means Redis lost its state.
        self.epoch = ""
        self._epoch_wait_us = 0  # how long the epoch seen last still holds dispatching back
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
            # A fresh epoch dispatches after a grace period: wait for it here, so that this
            # replica reports ready only when it can admit.
            wait_s = min(self.lease_ttl_us / 1e6, self._epoch_wait_us / 1e6)
            if wait_s > 0:
                await asyncio.sleep(wait_s)
        self._listener = asyncio.create_task(self._listen(), name="redis-grant-listener")

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait([self._listener], timeout=2)
        if self._flushes:  # script calls in flight: let them answer their callers (bounded)
            await asyncio.wait(set(self._flushes), timeout=2)
        with contextlib.suppress(*_UNAVAILABLE):
            await asyncio.wait_for(self.client.delete(self.keys.replica(self.replica_id)), 2)
        for client in (self.client, self.blocking_client, self.control_client):
            with contextlib.suppress(*_UNAVAILABLE):
                await client.aclose()

    # -- script calls -------------------------------------------------------------------------

    def _args(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> list[str | int]:
        offers = sound_offers(offers)
        args = DispatchArgs(
            prefix=self.keys.prefix,
            pool=pool.name,
            caller=self.replica_id,
            lease_ttl_us=self.lease_ttl_us,
            state_ttl_ms=STATE_TTL_S * 1000,
            known_epoch=self.epoch,
            sweep_batch=SWEEP_BATCH,
            max_queue=pool.max_queue_size,
            preempt=pool.preempt_for_share,
            num_offers=len(offers),
        ).argv()
        for offer in offers:  # sound ones only (``routing.sound_offers``); the scripts re-check
            args += [
                offer.url,
                offer.slots_total,
                repr(float(offer.load_score)),
                offer.rows_free,
                offer.row_idle_ms,
                offer.report_age_ms,
            ]
        return args

    async def _dispatch(
        self, name: str, pool: PoolPolicy, offers: Sequence[EndpointOffer], own: ScriptArgs
    ) -> list[object]:
        """Run a pool's script: the shared arguments, the offers, then its own (``lua/args``)."""
        return await self._run(
            name, self.keys.pool(pool.name), self._args(pool, offers) + own.argv()
        )

    async def _run(self, name: str, keys: list[str], args: list[str | int]) -> list[object]:
        """Run a named script. Calls made in the same event-loop turn share one pipeline (one
        round trip); each script is still atomic on its own."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[object]] = loop.create_future()
        self._pending.append(_Call(name, keys, args, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush_calls)
        try:
            return await asyncio.wait_for(asyncio.shield(future), CALL_TIMEOUT_S)
        except TimeoutError as exc:
            raise _unavailable(exc) from exc

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
            replies = [exc] * len(calls)
        except Exception as exc:  # a bug here must still answer every waiting caller
            log.exception("Redis pipeline failed")
            replies = [exc] * len(calls)
        for call, reply in zip(calls, replies, strict=True):
            invalid = is_invalid(reply)
            if call.name in DISPATCHING_SCRIPTS and isinstance(reply, list) and not invalid:
                self._route_grants(str(call.args[_POOL_ARG]), dispatch_grants(reply))
            if call.future.done():
                continue
            if isinstance(reply, BaseException):
                # OOM, READONLY, a script error: Redis cannot take the step; nothing was done
                # (the scripts declare flags, so Redis refuses them before their first write).
                call.future.set_exception(_unavailable(reply))
            elif invalid and isinstance(reply, list):
                # A value out of bounds (a caller's bug: check_enqueue runs first): the script
                # refused it before its first write.
                what = invalid_name(reply)
                call.future.set_exception(
                    InvalidAdmissionValueError(f"admission refused the value of {what}")
                )
            else:
                call.future.set_result(list(reply))  # type: ignore[call-overload]

    async def _pipeline(self, calls: list[_Call]) -> list[object]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(self.scripts[call.name].sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    def _route_grants(self, pool_name: str, grants: list[tuple[str, str]]) -> None:
        """This replica's grants in a script's reply go to ``on_grant`` right here, not to the
        caller: a caller cancelled meanwhile (client gone) cannot drop them."""
        if self._on_grant is None:
            return
        for request_id, endpoint in grants:
            try:
                self._on_grant(pool_name, request_id, endpoint)
            except Exception:  # one failing delivery must not lose the others
                log.exception("could not deliver grant %r", request_id)

    def _result(self, reply: DispatchReply) -> DispatchResult:
        epoch = reply.epoch
        return DispatchResult(
            reply.queue_depth,
            reply.num_dispatched_total,
            reply.hold_us,
            state_lost=bool(self.epoch) and bool(epoch) and epoch != self.epoch,
        )

    async def enqueue(
        self,
        pool: PoolPolicy,
        offers: Sequence[EndpointOffer],
        request_id: str,
        priority: int,
        timeout_us: int,
        *,
        drain_gap_us: int = 1_000_000,
        aging_us: int = DEFAULT_AGING_US,
        demote_after_us: int | None = None,
        only_if_absent: bool = False,
        slots: int = 1,
        tenant: str = DEFAULT_TENANT,
        weight: int = 1,
        deadline_gap_us: int = 0,
        route: Route | None = None,
    ) -> DispatchResult:
        check_enqueue(
            pool,
            priority,
            timeout_us,
            drain_gap_us=drain_gap_us,
            aging_us=aging_us,
            demote_after_us=demote_after_us,
            slots=slots,
            tenant=tenant,
            weight=weight,
            deadline_gap_us=deadline_gap_us,
        )
        level = pool.level(priority)
        demote_us = demote_after_us if demote_after_us and demote_after_us < timeout_us else 0
        sendable = sendable_route(route)
        own = EnqueueArgs(
            request_id=request_id,
            priority=priority,
            timeout_us=timeout_us,
            max_queue_size=pool.max_queue_size,
            only_if_absent=only_if_absent,
            drain_gap_us=drain_gap_us,
            queue_timeout_us=promise_horizon_us(pool),
            aging_us=aging_us,
            level_max_queue_size=level.max_queue_size,
            demote_after_us=demote_us,
            slots=slots,
            tenant=tenant,
            weight=weight,
            deadline_gap_us=deadline_gap_us,
            route="" if sendable is None else sendable.encode(),
        )
        reply = DispatchReply.parse(await self._dispatch("enqueue", pool, offers, own))
        result = self._result(reply)
        if reply.status == "deadline":
            raise DeadlineUnreachableError.of(
                pool.name,
                timeout_us,
                retry_after_s=max(1, reply.retry_after_us // 1_000_000),
            )
        if reply.status == "unfit":
            raise NoEngineFitsError.of(pool.name, slots, most_slots(offers))
        if reply.status in ("full", "level_full"):
            whole = reply.status == "full"
            where = f"pool {pool.name!r}" if whole else f"level {priority} of {pool.name!r}"
            limit = pool.max_queue_size if whole else level.max_queue_size
            raise QueueFullError(
                f"queue of {where} is full ({limit} waiting)",
                queue_depth=result.queue_depth,
                num_dispatched_total=result.num_dispatched_total,
                retry_after_s=max(1, reply.retry_after_us // 1_000_000),
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
        own = ReleaseArgs(tuple(batch.request_ids))
        try:
            reply = await self._dispatch("release", batch.pool, batch.offers, own)
            result = self._result(DispatchReply.parse(reply))
        except BackendUnavailableError as exc:
            for future in batch.futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future in batch.futures:
            if not future.done():
                future.set_result(result)

    async def cancel(self, pool: PoolPolicy, request_id: str) -> CancelOutcome:
        reply = await self._dispatch("cancel", pool, [], CancelArgs(request_id))
        return cancel_outcome(reply)

    async def tick(self, pool: PoolPolicy, offers: Sequence[EndpointOffer]) -> DispatchResult:
        reply = await self._dispatch("tick", pool, offers, TickArgs())
        return self._result(DispatchReply.parse(reply))

    async def heartbeat(
        self, leases: dict[str, list[tuple[str, str, int]]], *, restore: bool
    ) -> bool:
        args = HeartbeatArgs(
            prefix=self.keys.prefix,
            caller=self.replica_id,
            lease_ttl_us=self.lease_ttl_us,
            state_ttl_ms=STATE_TTL_S * 1000,
            known_epoch=self.epoch,
            restore=restore,
            leases=heartbeat_leases(leases),
        ).argv()
        script = self.scripts["heartbeat"]
        try:
            # Its own client, outside the request pipeline: a burst must not delay it.
            reply = await asyncio.wait_for(
                script(keys=[], args=args, client=self.control_client), CALL_TIMEOUT_S
            )
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        beat = HeartbeatReply.parse(reply)
        intact = beat.was_alive and beat.epoch == (self.epoch or beat.epoch)
        if intact or restore or not self.epoch:
            self.epoch = beat.epoch
        self._epoch_wait_us = beat.wait_us
        return intact

    async def inflight(self, pool: PoolPolicy) -> dict[str, int]:
        key = self.keys.pool_key(pool.name, "inflight")
        try:
            raw = await asyncio.wait_for(self.client.hgetall(key), CALL_TIMEOUT_S)
        except _UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return {_text(endpoint): int(count) for endpoint, count in raw.items()}

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
                if isinstance(more, list):  # None when the list is empty
                    items += more
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: wait a little and listen again, forever
                if not isinstance(exc, _UNAVAILABLE):
                    log.exception("grant listener failed; listening again")
                await asyncio.sleep(0.25)
                continue
            for item in items:
                try:
                    pool_name, request_id, endpoint = _text(item).split(GRANT_SEPARATOR)
                    if self._on_grant is not None:
                        self._on_grant(pool_name, request_id, endpoint)
                except Exception:  # one bad item must not lose the others
                    log.exception("could not deliver grant %r", item)
