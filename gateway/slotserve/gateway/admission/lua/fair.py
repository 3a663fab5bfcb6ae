"""Weighted fair share within a priority level, in the dispatching scripts (see ``scripts.py``).

Start-time fair queuing (Goyal, Vin and Cheng's SFQ): each level of a pool has a virtual time V
and each tenant waiting at that level a finish tag F. A new entry's start tag is
``S = max(V, F_tenant)``, and ``F_tenant = S + slots * FAIR_UNIT // weight``; the level's entries
leave in start-tag order, and V moves to the start tag of each entry dispatched. So a tenant that
floods a level queues behind its own earlier requests, while a tenant at or below its share starts
at V, next in line; over any busy stretch each backlogged tenant gets slots in proportion to its
weight, whatever the cost estimate, across every replica (one atomic step on shared state).

Why SFQ and not deficit round robin: DRR needs a round-robin pointer over per-tenant queues and a
quantum per visit, so its dispatch step walks tenants; SFQ needs one number per tenant and one per
level and orders entries in a sorted set, which is exactly what the queue already is, so a
dispatch stays one ZRANGE. Its tags need no clock and no service-time estimate (a wrong estimate
would skew shares), and it is fair to a tenant that comes back after idling (it starts at V, not
with credit saved while away).

How it sits with the levels: the pool's queue (arrival + level x aging) decides which level has
the turn, exactly as before (so aging and DELAY demotion work as they did); within that level the
entry with the lowest start tag goes, ties in request-id order as a sorted set orders them. With
one tenant at a level the order is arrival order, as before.

State, per level, bounded and reset: ``P:{pool}:fair:{level}`` (HASH: ``=v`` -> V, tenant -> F)
and ``P:{pool}:fairq:{level}`` (ZSET: request id -> start tag), both deleted when the level has
nothing waiting (a new busy period starts from V = 0: nobody carries credit or debt across an
idle level), and with the other pool keys when the whole queue empties. A request refused at
enqueue (its queue full) gives its tenant's F back. A demoted (DELAY) entry's tag moves by
``DEMOTION_OFFSET`` like its queue score, and serving it does not move V.

Needs ``PREFIX``, ``POOL``, ``STATE_TTL_MS``, ``DEMOTION_OFFSET``, ``int``/``int_value`` and
``MAX_LEVEL``. ``fair_share.py`` is the in-process twin.
"""

from __future__ import annotations

from slotserve.contracts.redis_keys import Keys, lua_expr, lua_key
from slotserve.gateway.admission.fair_share import FAIR_UNIT, MAX_WEIGHT, V_FIELD

_KEYS, _POOL, _LEVEL = Keys(lua_expr("PREFIX")), lua_expr("POOL"), lua_expr("level")

FAIR = (
    f"""
local FAIR_UNIT, MAX_WEIGHT, V_FIELD = {FAIR_UNIT}, {MAX_WEIGHT}, '{V_FIELD}'
local function fair_key(level) return {lua_key(_KEYS.fair(_POOL, _LEVEL))} end
local function fairq_key(level) return {lua_key(_KEYS.fair_queue(_POOL, _LEVEL))} end
"""
    + r"""

-- ARGV text usable as a tenant's name (tenants.TENANT_NAME), else nil.
local function tenant_arg(s)
  if type(s) ~= 'string' or #s > 63 or not string.match(s, '^[%w][%w._-]*$') then return nil end
  if #s > 1 and not string.match(s, '[%w]$') then return nil end
  return s
end

-- A new entry's start tag S = max(V, F); F moves on by its cost. Returns F before (nil: none).
local function fair_add(rid, level, tenant, weight, slots)
  local fk, qk = fair_key(level), fairq_key(level)
  local before = redis.call('HGET', fk, tenant)
  local start = math.max(int_value(redis.call('HGET', fk, V_FIELD), 0), int_value(before, 0))
  redis.call('HSET', fk, tenant, int(start + slots * math.floor(FAIR_UNIT / weight)))
  redis.call('ZADD', qk, int(start), rid)
  redis.call('PEXPIRE', fk, STATE_TTL_MS)
  redis.call('PEXPIRE', qk, STATE_TTL_MS)
  return before
end

-- A refused newcomer's tenant gets its F back (only while its level still has a queue).
local function fair_undo(level, tenant, before)
  if int_value(redis.call('HGET', K_LEVELS, level), 0) <= 0 then return end
  if before then
    redis.call('HSET', fair_key(level), tenant, before)
    redis.call('PEXPIRE', fair_key(level), STATE_TTL_MS)
  else
    redis.call('HDEL', fair_key(level), tenant)
  end
end

-- The level's entry with the lowest start tag: {rid, tag}, or nil when it has none.
local function fair_head(level)
  local f = redis.call('ZRANGE', fairq_key(level), 0, 0, 'WITHSCORES')
  if #f == 0 then return nil end
  return f[1], tonumber(f[2])
end

-- V moves to the start tag of the entry dispatched (a demoted one's tag does not count).
local function fair_served(level, tag)
  if tag == nil or tag >= DEMOTION_OFFSET then return end
  local fk = fair_key(level)
  if tag > int_value(redis.call('HGET', fk, V_FIELD), 0) then
    redis.call('HSET', fk, V_FIELD, int(tag))
    redis.call('PEXPIRE', fk, STATE_TTL_MS)
  end
end

-- A level with nothing waiting starts its next busy period afresh.
local function fair_clear(level)
  redis.call('DEL', fair_key(level), fairq_key(level))
end

-- Every level's (one command: it runs whenever a script leaves the queue empty).
local function fair_clear_all()
  local keys = {}
  for level = 0, MAX_LEVEL do
    keys[#keys + 1] = fair_key(level)
    keys[#keys + 1] = fairq_key(level)
  end
  redis.call('DEL', unpack(keys))
end
"""
)
