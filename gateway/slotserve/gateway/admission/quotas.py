"""Tenant quotas: requests per minute, tokens per minute and requests in flight, fleet-wide.

Each per-minute limit ``L`` is a token bucket holding at most one minute's worth, refilled
continuously. Amounts are integers in units of 1/``UNITS_PER_TOKEN`` token, so the bucket refills
exactly ``L`` units per millisecond and every number stays an exact integer (in a Lua double
too, ``lua/quotas.py``): no rounding drifts between the two stores. A request takes one request
and its estimated tokens at once, or nothing; refused, it is told when the bucket will hold
enough (``Retry-After``).

Tokens are counted when known: at admission a request is charged an estimate (its body's bytes
/ 4, a generous prompt count, plus ``n * max_tokens``), and when a non-streaming answer's
``usage`` arrives the difference to prompt + completion tokens is charged or given back. A bucket
may run into debt (down to minus one minute's worth), which then holds the tenant's next
requests back. A tokens-per-minute limit below one request's estimate still lets that request
through when the bucket is full (it would otherwise never pass) and leaves the bucket in debt.

Two stores with the same arithmetic: ``InProcessQuotas`` (one replica) and ``RedisQuotas``
(``quotas_redis.py``; every replica, one atomic script per step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from slotserve.gateway.admission.tenants import Tenant

UNITS_PER_TOKEN = 60_000  # one minute in ms: a limit of L per minute refills L units per ms
MAX_COST_TOKENS = 1_000_000_000  # one request's charge or correction, at most (exact in Lua)
INFLIGHT_RETRY_AFTER_S = 1  # a tenant at its max in flight: nothing predicts when one ends

REFUSALS = ("max_inflight", "requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True)
class QuotaRefusal:
    """Why a request was refused and when to come back (``None``: a quota of zero, never)."""

    reason: str  # one of REFUSALS, or "zero_quota"
    retry_after_s: int | None


def refilled(level: int, at_ms: int, now_ms: int, per_minute: int) -> int:
    """A bucket's units at ``now_ms``: ``level`` at ``at_ms`` plus the refill, at most full."""
    elapsed = max(0, now_ms - at_ms)  # a clock that went back refills nothing
    return min(per_minute * UNITS_PER_TOKEN, level + elapsed * per_minute)


def wait_ms(level: int, need: int, per_minute: int) -> int:
    """Milliseconds until a bucket at ``level`` holds ``need`` units."""
    return max(0, -(-(need - level) // per_minute))


def token_need(cost_tokens: int, per_minute: int) -> int:
    """The units a request must find: its cost, but never more than a full bucket."""
    return min(cost_tokens * UNITS_PER_TOKEN, per_minute * UNITS_PER_TOKEN)


def retry_after_s(ms: int) -> int:
    return max(1, math.ceil(ms / 1000))


class QuotaStore(Protocol):
    async def take(self, tenant: Tenant, request_id: str, cost_tokens: int) -> QuotaRefusal | None:
        """Take one request, ``cost_tokens`` and an in-flight place for ``request_id`` (all or
        nothing); the refusal, or None when taken."""
        ...

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        """Correct the tokens bucket by ``tokens`` (negative: give back)."""
        ...

    async def release(self, tenant: Tenant, request_id: str) -> None:
        """Give the in-flight place of ``request_id`` back (safe to repeat)."""
        ...

    async def refresh(self, tenant: Tenant, request_ids: list[str]) -> None:
        """Keep these in-flight places held for another TTL (their replica is alive)."""
        ...

    async def close(self) -> None: ...


@dataclass
class _Bucket:
    level: int
    at_ms: int


@dataclass
class InProcessQuotas:
    """The one-replica store; entries in flight expire after ``inflight_ttl_s`` unrefreshed."""

    inflight_ttl_s: float = 10.0
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    _inflight: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> id -> expiry

    @staticmethod
    def _now_ms() -> int:
        return time.monotonic_ns() // 1_000_000

    def _level(self, tenant: str, kind: str, per_minute: int, now: int) -> _Bucket:
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = _Bucket(per_minute * UNITS_PER_TOKEN, now)
        bucket.level = refilled(bucket.level, bucket.at_ms, now, per_minute)
        bucket.at_ms = now
        self._buckets[(tenant, kind)] = bucket
        return bucket

    async def take(self, tenant: Tenant, request_id: str, cost_tokens: int) -> QuotaRefusal | None:
        if tenant.has_zero_quota:
            return QuotaRefusal("zero_quota", None)
        now = self._now_ms()
        cost_tokens = min(max(cost_tokens, 0), MAX_COST_TOKENS)
        waits: list[tuple[int, str]] = []
        held = self._inflight.setdefault(tenant.name, {})
        if tenant.max_inflight is not None:
            for rid in [rid for rid, expiry in held.items() if expiry <= now]:
                del held[rid]
            if len(held) >= tenant.max_inflight:
                waits.append((INFLIGHT_RETRY_AFTER_S * 1000, "max_inflight"))
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        requests = None if rpm is None else self._level(tenant.name, "rpm", rpm, now)
        tokens = None if tpm is None else self._level(tenant.name, "tpm", tpm, now)
        if requests is not None and rpm is not None and requests.level < UNITS_PER_TOKEN:
            waits.append((wait_ms(requests.level, UNITS_PER_TOKEN, rpm), "requests_per_minute"))
        if tokens is not None and tpm is not None:
            need = token_need(cost_tokens, tpm)
            if tokens.level < need:
                waits.append((wait_ms(tokens.level, need, tpm), "tokens_per_minute"))
        if waits:
            longest, reason = max(waits)
            return QuotaRefusal(reason, retry_after_s(longest))
        if tenant.max_inflight is not None:
            held[request_id] = now + int(self.inflight_ttl_s * 1000)
        if requests is not None:
            requests.level -= UNITS_PER_TOKEN
        if tokens is not None and tpm is not None:
            debt_floor = -tpm * UNITS_PER_TOKEN  # at most a minute of debt
            tokens.level = max(debt_floor, tokens.level - cost_tokens * UNITS_PER_TOKEN)
        return None

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        tpm = tenant.tokens_per_minute
        if not tpm:
            return
        tokens = max(-MAX_COST_TOKENS, min(tokens, MAX_COST_TOKENS))
        bucket = self._level(tenant.name, "tpm", tpm, self._now_ms())
        cap = tpm * UNITS_PER_TOKEN
        bucket.level = max(-cap, min(cap, bucket.level - tokens * UNITS_PER_TOKEN))

    async def release(self, tenant: Tenant, request_id: str) -> None:
        self._inflight.get(tenant.name, {}).pop(request_id, None)

    async def refresh(self, tenant: Tenant, request_ids: list[str]) -> None:
        held = self._inflight.get(tenant.name, {})
        expiry = self._now_ms() + int(self.inflight_ttl_s * 1000)
        for rid in request_ids:
            if rid in held:
                held[rid] = expiry

    async def close(self) -> None:
        return None

    def num_inflight(self, tenant_name: str) -> int:
        return len(self._inflight.get(tenant_name, {}))
