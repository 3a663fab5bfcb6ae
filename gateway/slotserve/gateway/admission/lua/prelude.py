"""What every dispatching script starts with (see ``scripts.py``): its keys, its arguments
checked, the offers, and the steps they share (the queue's head, grants, dispatch, the reply).

The shared arguments are ``redis_keys.DispatchArgs`` (bound to Lua locals by the contract, each
checked here before a script's first write); then the offers, ``OFFER_ARGS`` values each (url,
slots_total, load_score, rows_free, row_idle_ms, report_age_ms); ``REST`` is the index of the
script's own first argument.
Numbers are read and written as ``values.py`` does, fair order is ``fair.py``'s, the epoch
``epoch.py``'s and slot accounting ``slots.py``'s.
"""

from __future__ import annotations

from dataclasses import fields

from slotserve.contracts.pool_spec import MAX_PRIORITY_LEVELS
from slotserve.contracts.redis_keys import (
    OFFER_ARGS,
    POOL_KEY_NAMES,
    DispatchArgs,
    Keys,
    lua_expr,
    lua_key,
    lua_key_locals,
)
from slotserve.gateway.admission.lua.cache_wait import CACHE_WAIT
from slotserve.gateway.admission.lua.epoch import EPOCH
from slotserve.gateway.admission.lua.fair import FAIR
from slotserve.gateway.admission.lua.preempt import PREEMPT
from slotserve.gateway.admission.lua.routes import ROUTES
from slotserve.gateway.admission.lua.slots import SLOTS
from slotserve.gateway.admission.lua.values import VALUES
from slotserve.gateway.admission.types import (
    DEMOTION_OFFSET_US,
    MAX_QUEUE_SIZE,
    MAX_WAIT_US,
    PROMISE_GRACE_US,
    PROMISE_MEMORY,
    PROMISE_WINDOW_US,
)

# The bounds of the shared arguments that are integers (``DispatchArgs``), and the text ones that
# name keys; ``known_epoch`` is compared, never parsed.
_DISPATCH_INTS = {
    "lease_ttl_us": (1, MAX_WAIT_US),
    "state_ttl_ms": (1, MAX_WAIT_US),
    "sweep_batch": (1, 10_000),
    "max_queue": (0, MAX_QUEUE_SIZE),
    "preempt": (0, 1),
    "num_offers": (0, 10_000),
}
_DISPATCH_NAMES = ("prefix", "pool", "caller")


def _check_dispatch_args() -> str:
    """Lua that sets INVALID to the first shared argument out of its bounds (nil: all hold)."""
    lines = ["local INVALID = nil\n"]
    for number, field in enumerate(fields(DispatchArgs), start=1):
        if field.name in _DISPATCH_INTS:
            low, high = _DISPATCH_INTS[field.name]
            check = f"int_arg(ARGV[{number}], {low}, {high})"
        elif field.name in _DISPATCH_NAMES:
            check = f"name_arg(ARGV[{number}])"
        else:
            continue
        lines.append(f"if not INVALID and not {check} then INVALID = '{field.name}' end\n")
    checked = set(_DISPATCH_INTS) | set(_DISPATCH_NAMES) | {"known_epoch"}
    assert checked == {field.name for field in fields(DispatchArgs)}, "a DispatchArgs field"
    return "".join(lines)


# Keys as Lua builds them at run time from its PREFIX and POOL (``redis_keys.lua_key``).
_KEYS, _POOL = Keys(lua_expr("PREFIX")), lua_expr("POOL")


PRELUDE = (
    r"""#!lua flags=allow-cross-slot-keys
"""
    + lua_key_locals(POOL_KEY_NAMES)
    + VALUES
    + DispatchArgs.lua_locals()
    + _check_dispatch_args()
    + r"""local FIRST_OFFER = """
    + str(DispatchArgs.first_offer_index())
    + r"""
local OFFER_ARGS = """
    + str(OFFER_ARGS)
    + r"""
if not INVALID and FIRST_OFFER + NUM_OFFERS * OFFER_ARGS - 1 > #ARGV then
  INVALID = 'num_offers'
end
-- Offers that are not sound are skipped (routing.sound_offers); MOST_SLOTS: the largest engine.
local OFFERS, MOST_SLOTS = {}, 0
for i = 0, (INVALID and 0 or NUM_OFFERS) - 1 do
  local b = FIRST_OFFER + i * OFFER_ARGS
  local slots, load = int_arg(ARGV[b + 1], 1, MAX_OFFER_SLOTS), finite_arg(ARGV[b + 2])
  local rows = int_arg(ARGV[b + 3], 0, MAX_OFFER_ROWS)
  local idle = int_arg(ARGV[b + 4], 0, MAX_OFFER_ROW_IDLE_MS)
  local age = int_arg(ARGV[b + 5], 0, MAX_OFFER_AGE_MS)
  if slots and load and rows and idle and age then
    OFFERS[#OFFERS + 1] = {url = ARGV[b], slots = slots, load = load, rows = rows, idle = idle,
                           age = age}
    MOST_SLOTS = math.max(MOST_SLOTS, slots)
  end
end
local REST = FIRST_OFFER + (INVALID and 0 or NUM_OFFERS) * OFFER_ARGS
local DEMOTION_OFFSET, MAX_LEVEL, PROMISE_WINDOW_US, PROMISE_GRACE_US = """
    + f"{DEMOTION_OFFSET_US}, {MAX_PRIORITY_LEVELS}, {PROMISE_WINDOW_US}, {PROMISE_GRACE_US}"
    + f"\nlocal PROMISE_MEMORY = {PROMISE_MEMORY}"
    + r"""
"""
    + FAIR
    + EPOCH
    + ROUTES
    + r"""
local EPOCH_ID, READY_AT = '', 0
local HELD, FREED = nil, 0  -- places held for promised clients; leases freed by this script

local function stat(name) return int_value(redis.call('HGET', K_STATS, name), 0) end

local alive = {[CALLER] = true}
local function is_alive(replica)
  if alive[replica] == nil then
    alive[replica] = redis.call('EXISTS', """
    + lua_key(_KEYS.replica(lua_expr("replica")))
    + r""") == 1
  end
  return alive[replica]
end

local function waiting_key(replica)
  return """
    + lua_key(_KEYS.waiting(_POOL, lua_expr("replica")))
    + r"""
end

-- replica|deadline|enqueued|level|slots, numbers as digits (the replica's name may hold '|': the
-- match is greedy); nil when it does not parse or holds values no entry can have.
local function parse_entry(info)
  local replica, deadline, enqueued, level, slots =
    string.match(info, '^(.+)|(%d+)|(%d+)|(%d+)|(%d+)$')
  if not replica then  -- written before leases weighed slots: one slot
    replica, deadline, enqueued, level = string.match(info, '^(.+)|(%d+)|(%d+)|(%d+)$')
    slots = '1'
  end
  if not replica or #deadline > 16 or #enqueued > 16 or #level > 2 or #slots > 5 then
    return nil
  end
  slots = tonumber(slots)
  if tonumber(level) > MAX_LEVEL or slots < 1 or slots > MAX_LEASE_SLOTS then return nil end
  return replica, tonumber(deadline), tonumber(enqueued), level, slots
end

-- An entry that does not parse: what can be read of its replica and level, so that their
-- counts are undone; counted, and never an error.
local function salvage_entry(info)
  redis.call('HINCRBY', K_STATS, 'bad_entries', 1)
  local replica, level = string.match(info, '^(.+)|[^|]*|[^|]*|([^|]*)|[^|]*$')
  if level and not int_value(level, nil) then level = nil end
  return replica, level
end

local function entry_owner(info)
  local replica, _, _, level = parse_entry(info)
  if replica then return replica, level end
  return salvage_entry(info)
end

-- Waiting requests per level (for each level's own maxQueueSize).
local function count_level(level, delta)
  if redis.call('HINCRBY', K_LEVELS, level, delta) <= 0 then
    redis.call('HDEL', K_LEVELS, level)
    fair_clear(level)
  end
end

local function drop(rid)
  local info = redis.call('HGET', K_ENTRIES, rid)
  redis.call('ZREM', K_QUEUE, rid)
  redis.call('ZREM', K_DEADLINES, rid)
  redis.call('ZREM', K_DELAYS, rid)
  redis.call('HDEL', K_ROUTES, rid)
  redis.call('HDEL', K_ENTRY_TENANTS, rid)
  if info then
    redis.call('HDEL', K_ENTRIES, rid)
    local replica, level = entry_owner(info)
    if replica then redis.call('ZREM', waiting_key(replica), rid) end
    if level then
      redis.call('ZREM', fairq_key(level), rid)
      count_level(level, -1)
    end
  end
end

-- drop() for a batch, a few variadic commands instead of five per entry.
local function drop_many(rids)
  if #rids == 0 then return end
  local infos = redis.call('HMGET', K_ENTRIES, unpack(rids))
  redis.call('ZREM', K_QUEUE, unpack(rids))
  redis.call('ZREM', K_DEADLINES, unpack(rids))
  redis.call('ZREM', K_DELAYS, unpack(rids))
  redis.call('HDEL', K_ENTRIES, unpack(rids))
  redis.call('HDEL', K_ROUTES, unpack(rids))
  redis.call('HDEL', K_ENTRY_TENANTS, unpack(rids))
  local by_replica, by_level = {}, {}
  for i = 1, #rids do
    if infos[i] then
      local replica, level = entry_owner(infos[i])
      if replica then
        by_replica[replica] = by_replica[replica] or {}
        table.insert(by_replica[replica], rids[i])
      end
      if level then
        by_level[level] = by_level[level] or {}
        table.insert(by_level[level], rids[i])
      end
    end
  end
  for level, list in pairs(by_level) do
    redis.call('ZREM', fairq_key(level), unpack(list))
    count_level(level, -#list)
  end
  for replica, list in pairs(by_replica) do
    redis.call('ZREM', waiting_key(replica), unpack(list))
  end
end

-- DELAY: a request past its level's timeout goes behind everyone not demoted (its fair tag
-- too: behind its level's entries not demoted).
local function demote(rids)
  for _, rid in ipairs(rids) do
    redis.call('ZADD', K_QUEUE, 'XX', 'INCR', DEMOTION_OFFSET, rid)
    redis.call('ZREM', K_DELAYS, rid)
    local _, _, _, level = parse_entry(redis.call('HGET', K_ENTRIES, rid) or '')
    if level then redis.call('ZADD', fairq_key(level), 'XX', 'INCR', DEMOTION_OFFSET, rid) end
  end
end

-- The queue's head says which level has the turn (arrival + level x aging); within that level
-- the entry with the lowest fair start tag goes (``fair.py``), checked as the head is.
-- The oldest live entry of the best priority; expired, orphaned or dead replicas' heads are
-- dropped on the way, one by one, so only a few per script: the tick drops the rest in batches.
-- A head due for demotion is demoted (it only moves back, so checking heads is enough).
local drops_left, demotions_left = 16, 64
local function head(now)
  while drops_left > 0 do
    local h = redis.call('ZRANGE', K_QUEUE, 0, 0)
    if #h == 0 then return nil end
    local rid, tag, level = h[1], nil, nil
    local info = redis.call('HGET', K_ENTRIES, rid)
    if info then
      level = select(4, parse_entry(info))
      local fair_rid, fair_tag = nil, nil
      if level then fair_rid, fair_tag = fair_head(level) end
      if fair_rid and fair_rid ~= rid then
        local due_head = tonumber(redis.call('ZSCORE', K_DELAYS, rid) or '-1')
        if due_head < 0 or due_head > now then
          rid, info = fair_rid, redis.call('HGET', K_ENTRIES, fair_rid)
        end
      end
      if rid == fair_rid then tag = fair_tag end
    end
    local due = tonumber(redis.call('ZSCORE', K_DELAYS, rid) or '-1')
    if rid ~= h[1] and not info then
      redis.call('ZREM', fairq_key(level), rid)  -- a tag whose entry is gone (a hand edit)
      drops_left = drops_left - 1
    elseif info and due >= 0 and due <= now then
      if demotions_left == 0 then return nil end  -- the tick demotes the rest in batches
      demote({rid})
      demotions_left = demotions_left - 1
    else
      if info then
        local replica, deadline, enqueued, _, slots = parse_entry(info)
        if replica and deadline > now and is_alive(replica) then
          return rid, replica, enqueued, slots, level, tag
        end
      end
      drop(rid)  -- expired, its replica dead, or it does not parse (counted)
      drops_left = drops_left - 1
    end
  end
  return nil
end

-- Places held for clients told to come back later (Retry-After): capacity that frees (a lease
-- released) while promises are outstanding is held for them, and opens when a promise is due,
-- so that the client who comes back when told finds it and a newcomer does not take it. Held
-- places expire: only promises due within PROMISE_WINDOW_US hold one (a client that never comes
-- back holds nothing for longer), and at most 3/4 of the queue is ever held (newcomers keep the
-- rest, however many clients were told to come back).
-- Promises kept and lapsed lately (types.kept_share): promises count, and hold
-- places, in the share of them that their clients kept.
local function count_promises(kept, lapsed)
  if kept + lapsed == 0 then return end
  kept, lapsed = stat('kept') + kept, stat('lapsed') + lapsed
  while kept + lapsed > PROMISE_MEMORY do
    kept, lapsed = math.floor(kept / 2), math.floor(lapsed / 2)
  end
  redis.call('HSET', K_STATS, 'kept', int(kept), 'lapsed', int(lapsed))
end

local function kept_share(n)
  local kept, lapsed = stat('kept'), stat('lapsed')
  return math.floor((n * (kept + 1) + kept + lapsed) / (kept + lapsed + 1))
end

-- A promise stays in K_RETRIES from its due time for PROMISE_GRACE_US: a return then keeps it
-- (keep_promise); past that it lapses, its client gone, and counts ahead of nobody any more.
-- ``settled``: the time up to which due promises have opened their places.
local NEAR = 0  -- promises not yet due, due within the window (in the share kept)
local function settle_promises(now)
  if HELD ~= nil then return end
  local due = redis.call('ZCOUNT', K_RETRIES, '(' .. int(stat('settled')), int(now))
  redis.call('HSET', K_STATS, 'settled', int(now))
  local lapsed = redis.call('ZREMRANGEBYSCORE', K_RETRIES, '-inf', int(now - PROMISE_GRACE_US))
  count_promises(0, lapsed)
  NEAR = redis.call('ZCOUNT', K_RETRIES, '(' .. int(now), int(now + PROMISE_WINDOW_US))
  NEAR = kept_share(NEAR)
  HELD = math.min(math.max(0, stat('held') - due), NEAR, math.floor(MAX_QUEUE * 3 / 4))
end

-- An arrival while promises are due is taken as a client coming back: it keeps the latest due
-- one (most likely its own), which then counts ahead of nobody.
local function keep_promise(now)
  local kept = redis.call('ZREVRANGEBYSCORE', K_RETRIES, int(now),
    '(' .. int(now - PROMISE_GRACE_US), 'LIMIT', 0, 1)
  if #kept > 0 then
    redis.call('ZREM', K_RETRIES, kept[1])
    count_promises(1, 0)
  end
end

local function hold_freed_places()
  if HELD == nil or FREED == 0 then return end
  local room = MAX_QUEUE - redis.call('ZCARD', K_QUEUE)
  HELD = math.max(0, math.min(HELD + FREED, NEAR, room, math.floor(MAX_QUEUE * 3 / 4)))
  FREED = 0
end

"""
    + PREEMPT
    + SLOTS
    + CACHE_WAIT
    + r"""
-- Every policy alike: the engine forms its batches (static, dynamic) from what arrives.
local refusals_left = SWEEP_BATCH
local function dispatch(now)
  settle_promises(now)
  EPOCH_ID, READY_AT = check_epoch(now)
  if now < READY_AT then return READY_AT - now end  -- leases may still be coming back
  while true do
    local rid, replica, _, slots, level, tag = head(now)
    if not rid then
      redis.call('HDEL', K_ROUTE_WAITS, ROOM_IDLE)  -- nobody left to dispatch waits
      return 0
    end
    if #OFFERS > 0 and slots > MOST_SLOTS then
      -- No ready engine can ever hold it (engines changed since it came): refused, so that it
      -- never blocks the queue behind it.
      if refusals_left == 0 then return 0 end  -- bounded work: the next step goes on
      refusals_left = refusals_left - 1
      refuse(rid, replica)
    else
      -- The head waits for all its slots, and those behind it wait for the head (FIFO); a
      -- head that waits for the engine holding its prefix lets one behind it pass
      -- (cache_wait.py).
      local route = decode_route(redis.call('HGET', K_ROUTES, rid))
      local ep, waits = best_endpoint(slots, route, rid, now)
      if waits then
        if not pass_head(level, rid, route.look_ahead, now) then
          -- Room goes unused while they wait: from now on it counts against the wait.
          redis.call('HSETNX', K_ROUTE_WAITS, ROOM_IDLE, int(now))
          return 0
        end
      else
        local tenant, victim = redis.call('HGET', K_ENTRY_TENANTS, rid) or nil, nil
        local routed = ep and route
        if not ep and PREEMPT == 1 and slots == 1 and tenant then
          -- No free slot: a tenant under its share may take one (preempt.py).
          ep, victim = pick_preemption(tenant, level)
        end
        if not ep and PREEMPT == 1 and level then
          -- The head may not preempt: one behind it may (preempt.py).
          local b_rid, b_replica, b_tag, b_ep, b_victim, b_tenant =
            preemptor_behind(tenant, level, now)
          if b_rid then
            rid, replica, tag, slots = b_rid, b_replica, b_tag, 1
            ep, victim, tenant = b_ep, b_victim, b_tenant
          end
        end
        if not ep then
          redis.call('HDEL', K_ROUTE_WAITS, ROOM_IDLE)  -- no room left: nothing goes unused
          return 0
        end
        if level then fair_served(level, tag) end
        grant(rid, replica, ep.url, slots, now, true, tenant, victim)
        if routed then route_granted(route, ep.url, rid, now) end
      end
    end
  end
end

local function touch()
  hold_freed_places()
  if HELD ~= nil then redis.call('HSET', K_STATS, 'held', int(HELD)) end
  if redis.call('ZCARD', K_QUEUE) == 0 then
    -- Nothing waits: whatever drift the counts of waiting requests had ends here.
    redis.call('DEL', K_ENTRIES, K_LEVELS, K_DEADLINES, K_DELAYS, K_ROUTES, K_ROUTE_WAITS,
      K_ENTRY_TENANTS)
    fair_clear_all()
  end
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], STATE_TTL_MS) end
end

-- {status, queue depth, dispatched so far, hold (us), epoch, retry after (us), grants...}
local function result(status, hold, retry_us)
  local out = {status, redis.call('ZCARD', K_QUEUE), stat('dispatched'), hold,
               EPOCH_ID, retry_us or 0}
  for _, v in ipairs(mine) do out[#out + 1] = v end
  return out
end
"""
)
