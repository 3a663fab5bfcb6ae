"""Tenant quotas shared by every gateway replica: one Redis, one atomic script per step.

Keys: ``{prefix}:tenant:{name}:rpm``, ``...:tpm`` (hashes: ``level``, ``at``) and
``...:inflight`` (sorted set: request id -> expiry ms), every one with a TTL. Tenant names are
bounded by ``tenants.check_tenant_name``, so a key is never longer than a few dozen bytes. Every
call is bounded by ``CALL_TIMEOUT_S``; an unreachable Redis raises ``QuotaUnavailableError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from slotserve.contracts.redis_keys import Keys, ScriptArgs
from slotserve.gateway.admission.backends.redis import CALL_TIMEOUT_S, make_client
from slotserve.gateway.admission.lua.args import ChargeArgs, RefreshArgs, TakeArgs
from slotserve.gateway.admission.lua.quotas import SCRIPTS
from slotserve.gateway.admission.lua.replies import TakeReply
from slotserve.gateway.admission.quotas import MAX_COST_TOKENS, QuotaRefusal, retry_after_s
from slotserve.gateway.admission.tenants import Tenant

_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    TimeoutError,
    OSError,
)


class QuotaUnavailableError(Exception):
    """Redis did not answer a quota step in time."""


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisQuotas:
    def __init__(self, url: str, prefix: str, inflight_ttl_s: float = 10.0) -> None:
        self.client = make_client(url)
        self.prefix = prefix
        self.inflight_ttl_ms = max(1, int(inflight_ttl_s * 1000))
        self.scripts = {name: self.client.register_script(src) for name, src in SCRIPTS.items()}

    def keys(self, tenant: Tenant) -> list[str]:
        return Keys(self.prefix).tenant(tenant.name)

    async def _call(self, name: str, tenant: Tenant, args: ScriptArgs) -> Any:
        try:
            call: Awaitable[Any] = self.scripts[name](keys=self.keys(tenant), args=args.argv())
            return await asyncio.wait_for(call, CALL_TIMEOUT_S)
        except _UNAVAILABLE as exc:
            raise QuotaUnavailableError(str(exc) or type(exc).__name__) from exc

    async def take(self, tenant: Tenant, request_id: str, cost_tokens: int) -> QuotaRefusal | None:
        if tenant.has_zero_quota:
            return QuotaRefusal("zero_quota", None)
        args = TakeArgs(
            request_id=request_id,
            max_inflight=_limit(tenant.max_inflight),
            requests_per_minute=_limit(tenant.requests_per_minute),
            tokens_per_minute=_limit(tenant.tokens_per_minute),
            cost_tokens=min(max(cost_tokens, 0), MAX_COST_TOKENS),
            inflight_ttl_ms=self.inflight_ttl_ms,
        )
        reply = TakeReply.parse(await self._call("take", tenant, args))
        if reply.reason == "ok":
            return None
        if reply.reason == "zero_quota":
            return QuotaRefusal("zero_quota", None)
        if reply.reason == "invalid":  # every value was bounded before the call: a bug, loudly
            raise ValueError(f"quota script refused the arguments for tenant {tenant.name!r}")
        return QuotaRefusal(reply.reason, retry_after_s(reply.wait_ms))

    async def charge(self, tenant: Tenant, tokens: int) -> None:
        if not tenant.tokens_per_minute:
            return
        tokens = max(-MAX_COST_TOKENS, min(tokens, MAX_COST_TOKENS))
        await self._call("charge", tenant, ChargeArgs(tenant.tokens_per_minute, tokens))

    async def release(self, tenant: Tenant, request_id: str) -> None:
        try:
            await asyncio.wait_for(
                self.client.zrem(self.keys(tenant)[2], request_id), CALL_TIMEOUT_S
            )
        except _UNAVAILABLE as exc:
            raise QuotaUnavailableError(str(exc) or type(exc).__name__) from exc

    async def refresh(self, tenant: Tenant, request_ids: list[str]) -> None:
        if request_ids:
            await self._call(
                "refresh", tenant, RefreshArgs(self.inflight_ttl_ms, tuple(request_ids))
            )

    async def close(self) -> None:
        client: aioredis.Redis = self.client
        await client.aclose()
