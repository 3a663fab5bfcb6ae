"""The Lua scripts of the tenant quotas (``quotas_redis.py``): the arithmetic of ``quotas.py``.

Each script is one atomic step on one tenant's keys (``redis_keys.TENANT_KEY_NAMES``, bound to
``K_RPM``, ``K_TPM``, ``K_INFLIGHT``): its requests bucket, its tokens bucket, its in-flight
sorted set (request id -> expiry ms). Its arguments are ``args.TakeArgs``, ``ChargeArgs`` and
``RefreshArgs``, bound to ``ARG_*`` locals.
Time is Redis's own (``TIME``), one clock for every replica. Numbers are read with
``int_arg``/``int_value`` and written with ``int`` (``values.py``): digits, exactly. Every
ARGV is checked before the first write, so a bad call writes nothing. A bucket key expires when
it would have refilled to full anyway (absent = full); the in-flight set when no replica has
refreshed it for a TTL.
"""

from __future__ import annotations

from slotserve.contracts.redis_keys import TENANT_KEY_NAMES, ScriptArgs, lua_key_locals
from slotserve.gateway.admission.lua.args import ChargeArgs, RefreshArgs, TakeArgs
from slotserve.gateway.admission.lua.values import VALUES
from slotserve.gateway.admission.quotas import MAX_COST_TOKENS, UNITS_PER_TOKEN
from slotserve.gateway.admission.tenants import MAX_INFLIGHT, MAX_PER_MINUTE

MAX_TTL_MS = 86_400_000

COMMON = (
    VALUES
    + lua_key_locals(TENANT_KEY_NAMES)
    + f"""
local UNITS, MAX_COST = {UNITS_PER_TOKEN}, {MAX_COST_TOKENS}
local MAX_INFLIGHT, MAX_PER_MINUTE, MAX_TTL_MS = {MAX_INFLIGHT}, {MAX_PER_MINUTE}, {MAX_TTL_MS}
"""
    + r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A bucket's units now (absent: full), as quotas.refilled.
local function level_of(key, per_minute, now)
  local cap = per_minute * UNITS
  local state = redis.call('HMGET', key, 'level', 'at')
  local level = int_value(state[1], cap)
  local at = int_value(state[2], now)
  if level > cap then level = cap end
  if level < -cap then level = -cap end
  local elapsed = now - at
  if elapsed < 0 then elapsed = 0 end
  return math.min(cap, level + elapsed * per_minute)
end

-- Write a bucket's level; the key lives until it would be full again (then absent = full).
local function write_level(key, level, per_minute, now)
  local cap = per_minute * UNITS
  if level < -cap then level = -cap end
  if level > cap then level = cap end
  redis.call('HSET', key, 'level', int(level), 'at', int(now))
  local full_in = math.floor((cap - level) / per_minute) + 1000
  redis.call('PEXPIRE', key, int(full_in))
end

local function wait_for(level, need, per_minute)
  local short = need - level
  if short <= 0 then return 0 end
  return math.ceil(short / per_minute)
end
"""
)

# Reply: ``replies.TakeReply``.
TAKE = (
    COMMON
    + TakeArgs.lua_args(1)
    + r"""
local rid = name_arg(ARG_REQUEST_ID)
local max_inflight = int_arg(ARG_MAX_INFLIGHT, -1, MAX_INFLIGHT)
local rpm = int_arg(ARG_REQUESTS_PER_MINUTE, -1, MAX_PER_MINUTE)
local tpm = int_arg(ARG_TOKENS_PER_MINUTE, -1, MAX_PER_MINUTE)
local cost = int_arg(ARG_COST_TOKENS, 0, MAX_COST)
local ttl = int_arg(ARG_INFLIGHT_TTL_MS, 1, MAX_TTL_MS)
if not (rid and max_inflight and rpm and tpm and cost and ttl) then return {'invalid', 0} end
if max_inflight == 0 or rpm == 0 or tpm == 0 then return {'zero_quota', 0} end
local now = now_ms()
local wait, reason = -1, ''
if max_inflight > 0 then
  redis.call('ZREMRANGEBYSCORE', K_INFLIGHT, '-inf', now)  -- places of replicas gone quiet
  if redis.call('ZCARD', K_INFLIGHT) >= max_inflight then wait, reason = 1000, 'max_inflight' end
end
local requests, tokens
if rpm > 0 then
  requests = level_of(K_RPM, rpm, now)
  local w = wait_for(requests, UNITS, rpm)
  if w > 0 and w > wait then wait, reason = w, 'requests_per_minute' end
end
if tpm > 0 then
  tokens = level_of(K_TPM, tpm, now)
  local w = wait_for(tokens, math.min(cost * UNITS, tpm * UNITS), tpm)
  if w > 0 and w > wait then wait, reason = w, 'tokens_per_minute' end
end
if reason ~= '' then return {reason, int(wait)} end
if max_inflight > 0 then
  redis.call('ZADD', K_INFLIGHT, int(now + ttl), rid)
  redis.call('PEXPIRE', K_INFLIGHT, int(ttl))
end
if rpm > 0 then write_level(K_RPM, requests - UNITS, rpm, now) end
if tpm > 0 then write_level(K_TPM, tokens - cost * UNITS, tpm, now) end
return {'ok', 0}
"""
)

CHARGE = (
    COMMON
    + ChargeArgs.lua_args(1)
    + r"""
local tpm = int_arg(ARG_TOKENS_PER_MINUTE, 1, MAX_PER_MINUTE)
local tokens = int_arg(ARG_TOKENS, -MAX_COST, MAX_COST)
if not (tpm and tokens) then return 'invalid' end
local now = now_ms()
write_level(K_TPM, level_of(K_TPM, tpm, now) - tokens * UNITS, tpm, now)
return 'ok'
"""
)

REFRESH = (
    COMMON
    + RefreshArgs.lua_args(1)
    + r"""
local ttl = int_arg(ARG_INFLIGHT_TTL_MS, 1, MAX_TTL_MS)
if not ttl then return 'invalid' end
local now = now_ms()
for i = ARG_REQUEST_IDS_AT, #ARGV do
  local rid = name_arg(ARGV[i])
  if rid then redis.call('ZADD', K_INFLIGHT, 'XX', int(now + ttl), rid) end
end
if redis.call('EXISTS', K_INFLIGHT) == 1 then redis.call('PEXPIRE', K_INFLIGHT, int(ttl)) end
return 'ok'
"""
)

SCRIPTS = {"take": TAKE, "charge": CHARGE, "refresh": REFRESH}
SCRIPT_ARGS: dict[str, type[ScriptArgs]] = {
    "take": TakeArgs,
    "charge": ChargeArgs,
    "refresh": RefreshArgs,
}
