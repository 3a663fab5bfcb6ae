"""Slot accounting shared by the dispatching scripts (see ``scripts.py``): a lease weighs slots.

A request takes one engine slot per choice (its ``n``), so its lease holds ``n`` slots:
``inflight`` counts slots, not requests, and an endpoint is offered only to a request whose
slots all fit. Leases of one slot (nearly all) store no weight; others store it in
``P:{pool}:lease_slots``, which release, expiry and the heartbeat's restore read back.
A request that no offered engine can hold is refused through the same delivery as a grant, with an
empty endpoint (``types.REFUSED``). Needs the prelude's keys, ``OFFERS``, ``FREED``,
``CALLER``, ``drop``, ``int``/``int_value`` (``values.py``), ``LEASE_TTL_US`` and
``routes.py``'s ``pick_routed``.
"""

from __future__ import annotations

from slotserve.contracts.redis_keys import Keys, lua_expr, lua_key

SLOTS = (
    r"""
-- The slots a lease holds (absent: one; unreadable: one, and counted).
local function lease_slots(rid)
  local raw = redis.call('HGET', K_LEASE_SLOTS, rid)
  if not raw then return 1 end
  local n = int_value(raw, nil)
  if n == nil or n < 1 or n > MAX_LEASE_SLOTS then
    redis.call('HINCRBY', K_STATS, 'bad_entries', 1)
    return 1
  end
  return n
end

-- routing.rank_endpoints: room for `need` slots, lowest held share, then engine load, then URL;
-- with a route, routing.pick_endpoint among those (``routes.py``). Returns nil and true while
-- the request waits for the full engine holding its prefix (``routes.py``'s ``pick_routed``;
-- `rid` the waiting request, nil at the enqueue's fast path).
local function better(a, b)
  return a.ratio < b.ratio or (a.ratio == b.ratio and (a.load < b.load
    or (a.load == b.load and a.url < b.url)))
end

local function best_endpoint(need, route, rid, now)
  local best, eligible, all = nil, {}, {}
  for _, o in ipairs(OFFERS) do
    local used = tonumber(redis.call('HGET', K_INFLIGHT, o.url) or '0')
    local c = {url = o.url, load = o.load, ratio = used / o.slots, used = used, slots = o.slots,
               rows = o.rows, idle = o.idle}
    if route then claimed(c, o, now) end
    all[#all + 1] = c
    if used + need <= o.slots then
      eligible[#eligible + 1] = c
      if best == nil or better(c, best) then best = c end
    end
  end
  if best == nil or route == nil then return best, false end
  return pick_routed(best, eligible, all, route, better, need, rid, now)
end

local function release_lease(rid)
  if redis.call('ZREM', K_LEASES, rid) == 0 then return false end
  FREED = FREED + 1
  local ep, n = redis.call('HGET', K_LEASE_ENDPOINT, rid), lease_slots(rid)
  redis.call('HDEL', K_LEASE_ENDPOINT, rid)
  redis.call('HDEL', K_LEASE_SLOTS, rid)
  local tenant = redis.call('HGET', K_LEASE_TENANTS, rid)
  if tenant then
    redis.call('HDEL', K_LEASE_TENANTS, rid)
    if ep then count_held(tenant, ep, -n) end
  end
  if ep and redis.call('HINCRBY', K_INFLIGHT, ep, int(-n)) <= 0 then
    redis.call('HDEL', K_INFLIGHT, ep)
  end
  return true
end

local mine = {}

-- To the caller in the reply, to another replica on its grant list.
-- A preempting grant carries its victim tenant after '\30' (preempt_share.PREEMPT_MARK).
local function deliver(rid, replica, url)
  if replica == CALLER then
    mine[#mine + 1] = rid
    mine[#mine + 1] = url
  else
    local gk = """
    + lua_key(Keys(lua_expr("PREFIX")).grants(lua_expr("replica")))
    + r"""
    redis.call('RPUSH', gk, POOL .. '\31' .. rid .. '\31' .. url)
    redis.call('PEXPIRE', gk, int(math.floor(LEASE_TTL_US / 1000)))
  end
end

-- ``tenant``: whose slots the lease holds (counted for preemption; nil: an entry from before);
-- ``victim``: a preempting grant's (preempt.py).
local function grant(rid, replica, url, slots, now, queued, tenant, victim)
  if queued ~= false then drop(rid) end
  redis.call('ZADD', K_LEASES, int(now + LEASE_TTL_US), rid)
  redis.call('HSET', K_LEASE_ENDPOINT, rid, url)
  if slots > 1 then redis.call('HSET', K_LEASE_SLOTS, rid, int(slots)) end
  redis.call('HINCRBY', K_INFLIGHT, url, int(slots))
  redis.call('HINCRBY', K_STATS, 'dispatched', 1)
  if tenant then
    redis.call('HSET', K_LEASE_TENANTS, rid, tenant)
    count_held(tenant, url, slots)
  end
  if victim then
    redis.call('HINCRBY', K_STATS, 'preempting', 1)
    deliver(rid, replica, url .. '\30' .. victim)
  else
    deliver(rid, replica, url)
  end
end

-- A queued request that no offered engine can hold: out of the queue, told so (no lease).
local function refuse(rid, replica)
  drop(rid)
  redis.call('HINCRBY', K_STATS, 'refused', 1)
  deliver(rid, replica, '')
end
"""
)
