"""The admission epoch, shared by every script, and the heartbeat script (see ``scripts.py``).

The admission epoch (``P:epoch``): Redis that lost its data (FLUSHALL, restart without
persistence, failover to an empty replica) also lost the leases of requests still running. The
first script to find the epoch missing starts a new one whose dispatching waits one lease TTL
(half of it when the caller knew no epoch: a fresh Redis). Every live replica heartbeats at
least every lease TTL / 4 and finds the new epoch on its next step, writes its leases back, and
only then does anyone dispatch; so in-flight never exceeds slots across the loss.
"""

from __future__ import annotations

from slotserve.contracts.redis_keys import POOL_KEY_NAMES, Keys, lua_expr, lua_key
from slotserve.gateway.admission.lua.args import HeartbeatArgs
from slotserve.gateway.admission.lua.values import VALUES

# Keys as Lua builds them at run time from its PREFIX (``redis_keys.lua_key``).
_KEYS = Keys(lua_expr("PREFIX"))
# The keys of a pool's leases that the heartbeat renews and restores, in the order it renews.
_LEASE_KEYS = (
    "leases",
    "lease_endpoint",
    "lease_slots",
    "inflight",
    "lease_tenants",
    "tenant_held",
    "tenant_held_at",
)

# Shared by every script: the epoch check (needs ``values.VALUES``, PREFIX, CALLER,
# LEASE_TTL_US, STATE_TTL_MS, KNOWN_EPOCH).
EPOCH = (
    r"""
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local K_EPOCH = """
    + lua_key(_KEYS.epoch())
    + r"""

-- Returns the epoch id and the time (us) from which dispatching is allowed.
local function check_epoch(now)
  local e = redis.call('HMGET', K_EPOCH, 'id', 'created', 'ready')
  local id, created, ready = e[1], int_value(e[2], 0), int_value(e[3], 0)
  if not id then
    id = int(now) .. '-' .. CALLER
    created = now
    if KNOWN_EPOCH ~= '' then
      ready = now + LEASE_TTL_US  -- a loss seen by a replica that holds state: wait a full TTL
    else
      ready = now + math.floor(LEASE_TTL_US / 2)
    end
    redis.call('HSET', K_EPOCH, 'id', id, 'created', int(created), 'ready', int(ready))
  elseif KNOWN_EPOCH ~= '' and KNOWN_EPOCH ~= id and ready < created + LEASE_TTL_US then
    -- The epoch was started by a replica that knew none: the loss is now certain.
    ready = created + LEASE_TTL_US
    redis.call('HSET', K_EPOCH, 'ready', int(ready))
  end
  redis.call('PEXPIRE', K_EPOCH, STATE_TTL_MS)
  return id, ready
end
"""
)


def _lease_keys() -> str:
    """``local k_leases = PREFIX .. ':{' .. pool .. '}:leases'`` ... for the pool ``pool``."""
    assert set(_LEASE_KEYS) <= set(POOL_KEY_NAMES), "a lease key the pools do not have"
    return "".join(
        f"  local k_{name} = {lua_key(_KEYS.pool_key(lua_expr('pool'), name))}\n"
        for name in _LEASE_KEYS
    )


# Not pool-bound: its arguments are ``args.HeartbeatArgs`` (the leases: per pool, its name, the
# number of leases N, N triples (request id, endpoint, slots it holds)). Renews liveness and
# leases; with restore, leases missing from Redis (it lost them) are written back. Returns
# {was alive (0/1), epoch id, us until it dispatches} (``replies.HeartbeatReply``), or
# {'invalid', what} without a write when the arguments do not hold (a triple whose slots are
# not 1..MAX_LEASE_SLOTS is skipped, the others kept).
HEARTBEAT = (
    r"""#!lua flags=allow-cross-slot-keys
"""
    + VALUES
    + HeartbeatArgs.lua_args(1)
    + r"""
local PREFIX, CALLER = name_arg(ARG_PREFIX), name_arg(ARG_CALLER)
local LEASE_TTL_US = int_arg(ARG_LEASE_TTL_US, 1, MAX_WAIT_US)
local STATE_TTL_MS = int_arg(ARG_STATE_TTL_MS, 1, MAX_WAIT_US)
local KNOWN_EPOCH, restore = ARG_KNOWN_EPOCH or '', ARG_RESTORE == '1'
if not (PREFIX and CALLER and LEASE_TTL_US and STATE_TTL_MS) then
  return {'invalid', 'heartbeat'}
end
-- The whole layout first: a script that stopped half-way would have renewed some leases only.
local i = ARG_LEASES_AT
while i <= #ARGV do
  local n = int_arg(ARGV[i + 1], 0, 1000000)
  if not name_arg(ARGV[i]) or not n or i + 1 + 3 * n > #ARGV then
    return {'invalid', 'heartbeat leases'}
  end
  i = i + 2 + 3 * n
end
"""
    + EPOCH
    + r"""
local now = now_us()
local replica_key = """
    + lua_key(_KEYS.replica(lua_expr("CALLER")))
    + r"""
local was_alive = redis.call('EXISTS', replica_key)
redis.call('SET', replica_key, '1', 'PX', int(math.floor(LEASE_TTL_US / 1000)))
local epoch, ready = check_epoch(now)
i = ARG_LEASES_AT
while i <= #ARGV do
  local pool, n = ARGV[i], tonumber(ARGV[i + 1])
"""
    + _lease_keys()
    + r"""  for j = i + 2, i + 3 * n - 1, 3 do
    local rid, ep = ARGV[j], ARGV[j + 1]
    local slots = int_arg(ARGV[j + 2], 1, MAX_LEASE_SLOTS)
    if not slots then
      -- skipped: a weight no lease can have (its lease expires after one TTL)
    elseif redis.call('ZSCORE', k_leases, rid) then
      redis.call('ZADD', k_leases, int(now + LEASE_TTL_US), rid)
    elseif restore then  -- a lease weighs its slots (``slots.py``)
      redis.call('ZADD', k_leases, int(now + LEASE_TTL_US), rid)
      redis.call('HSET', k_lease_endpoint, rid, ep)
      if slots > 1 then redis.call('HSET', k_lease_slots, rid, int(slots)) end
      redis.call('HINCRBY', k_inflight, ep, int(slots))
    end
  end
  for _, key in ipairs({"""
    + ", ".join(f"k_{name}" for name in _LEASE_KEYS)
    + r"""}) do
    redis.call('PEXPIRE', key, STATE_TTL_MS)
  end
  i = i + 2 + 3 * n
end
return {was_alive, epoch, math.max(0, ready - now)}
"""
)
