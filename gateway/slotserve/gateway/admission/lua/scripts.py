"""The named Lua scripts: every check-then-act of the Redis backend is one of these.

They mirror ``backends.memory.InProcessHub`` step for step (same ranking, same queue-full check),
so both backends pass the same test suite. Key order: ``keys.POOL_KEY_NAMES``.

Every script starts with ``#!lua flags=...`` so that Redis refuses it whole, before its first
command, when it cannot write (OOM under ``noeviction``, READONLY replica): a script stopped
half-way would leave a lease removed but its endpoint still counted (a slot lost for good).

Every script bounds its own work: expired leases, expired queue entries and dead replicas'
entries are swept ``SWEEP_BATCH`` at a time, oldest deadline first, so that no call blocks Redis
for long however many requests wait (the rest goes on the next tick).

Dispatching scripts share one argument layout, ``redis_keys.DispatchArgs`` (the prefix, pool,
calling replica, TTLs, known epoch, sweep batch, maxQueueSize and number of endpoint offers N),
then N triples (url, slots_total, load_score), then the script's own arguments. The batching
policy and its delay do not reach Redis: the engine forms batches.

No value can poison a pool (``values.py``): every argument is checked before a script's first
write (a script refuses a bad one whole, ``{'invalid', name}``), every number is written as its
digits, and an entry that does not parse (another gateway version, a hand edit) is dropped and
counted (``bad_entries`` in ``P:{pool}:stats``), never an error in every later script of the pool.
An offer that is not sound (slots outside 1..1024, a load that is not finite) is skipped, as
``routing.sound_offers`` skips it. A request that needs more slots than any offered engine has is
refused (enqueue: ``'unfit'``; at the head of the queue: a grant with an empty endpoint,
``types.REFUSED``), so it never blocks those behind it. With nothing waiting, the
counts of waiting requests are reset, so no drift outlives a drained queue.

The admission epoch and the heartbeat script live in ``epoch.py``; slot accounting (a lease
weighs its request's ``n`` slots) in ``slots.py``; reading and writing numbers in
``values.py``.
"""

from __future__ import annotations

from dataclasses import fields

from slotserve.contracts.pool_spec import MAX_PRIORITY_LEVELS
from slotserve.contracts.redis_keys import DispatchArgs
from slotserve.gateway.admission.lua.epoch import EPOCH, HEARTBEAT
from slotserve.gateway.admission.lua.fair import FAIR
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


_PRELUDE = (
    r"""#!lua flags=allow-cross-slot-keys
local K_QUEUE, K_ENTRIES, K_SEQ, K_LEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LEASE_EP, K_INFLIGHT, K_STATS, K_DEADLINES = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_REPLICAS, K_RETRIES, K_LEVELS, K_DELAYS = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local K_LEASE_SLOTS = KEYS[13]
"""
    + VALUES
    + DispatchArgs.lua_locals()
    + _check_dispatch_args()
    + r"""local FIRST_OFFER = """
    + str(DispatchArgs.first_offer_index())
    + r"""
if not INVALID and FIRST_OFFER + NUM_OFFERS * 3 - 1 > #ARGV then INVALID = 'num_offers' end
-- Offers that are not sound are skipped (routing.sound_offers); MOST_SLOTS: the largest engine.
local OFFERS, MOST_SLOTS = {}, 0
for i = 0, (INVALID and 0 or NUM_OFFERS) - 1 do
  local b = FIRST_OFFER + i * 3
  local slots, load = int_arg(ARGV[b + 1], 1, MAX_OFFER_SLOTS), finite_arg(ARGV[b + 2])
  if slots and load then
    OFFERS[#OFFERS + 1] = {url = ARGV[b], slots = slots, load = load}
    MOST_SLOTS = math.max(MOST_SLOTS, slots)
  end
end
local REST = FIRST_OFFER + (INVALID and 0 or NUM_OFFERS) * 3
local DEMOTION_OFFSET, MAX_LEVEL, PROMISE_WINDOW_US, PROMISE_GRACE_US = """
    + f"{DEMOTION_OFFSET_US}, {MAX_PRIORITY_LEVELS}, {PROMISE_WINDOW_US}, {PROMISE_GRACE_US}"
    + f"\nlocal PROMISE_MEMORY = {PROMISE_MEMORY}"
    + r"""
"""
    + FAIR
    + EPOCH
    + r"""
local EPOCH_ID, READY_AT = '', 0
local HELD, FREED = nil, 0  -- places held for promised clients; leases freed by this script

local function stat(name) return int_value(redis.call('HGET', K_STATS, name), 0) end

local alive = {[CALLER] = true}
local function is_alive(replica)
  if alive[replica] == nil then
    alive[replica] = redis.call('EXISTS', PREFIX .. ':replica:' .. replica) == 1
  end
  return alive[replica]
end

local function waiting_key(replica)
  return PREFIX .. ':{' .. POOL .. '}:waiting:' .. replica
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
    + SLOTS
    + r"""
-- Every policy alike: the engine forms its batches (static, dynamic) from what arrives.
local refusals_left = SWEEP_BATCH
local function dispatch(now)
  settle_promises(now)
  EPOCH_ID, READY_AT = check_epoch(now)
  if now < READY_AT then return READY_AT - now end  -- leases may still be coming back
  while true do
    local rid, replica, _, slots, level, tag = head(now)
    if not rid then return 0 end
    if #OFFERS > 0 and slots > MOST_SLOTS then
      -- No ready engine can ever hold it (engines changed since it came): refused, so that it
      -- never blocks the queue behind it.
      if refusals_left == 0 then return 0 end  -- bounded work: the next step goes on
      refusals_left = refusals_left - 1
      refuse(rid, replica)
    else
      -- The head waits for all its slots, and those behind it wait for the head (FIFO).
      local ep = best_endpoint(slots)
      if not ep then return 0 end
      if level then fair_served(level, tag) end
      grant(rid, replica, ep.url, slots, now)
    end
  end
end

local function touch()
  hold_freed_places()
  if HELD ~= nil then redis.call('HSET', K_STATS, 'held', int(HELD)) end
  if redis.call('ZCARD', K_QUEUE) == 0 then
    -- Nothing waits: whatever drift the counts of waiting requests had ends here.
    redis.call('DEL', K_ENTRIES, K_LEVELS, K_DEADLINES, K_DELAYS)
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

# Script arguments after the shared ones: request id, priority, timeout (us), maxQueueSize,
# only-if-absent flag, the expected gap (us) between two places freeing in the queue
# (1 / measured drain rate), how far ahead (us) return times are promised to rejected clients,
# the priority aging step (us of waiting worth one priority level), the level's own
# maxQueueSize, when (us from now) the request is demoted (DELAY; 0: never), the slots it
# takes (its ``n``), its tenant's name and weight (``fair.py``), and the gap (us) that predicts
# its wait for a deadline-aware refusal (0 or absent: none).
ENQUEUE = (
    _PRELUDE
    + r"""
if INVALID then return {'invalid', INVALID} end
-- Every argument is checked before the first write (types.check_enqueue's bounds).
local rid = name_arg(ARGV[REST])
local checks = {
  {'request id', rid},
  {'priority', int_arg(ARGV[REST + 1], 0, MAX_LEVEL)},
  {'timeout_us', int_arg(ARGV[REST + 2], 1, MAX_WAIT_US)},
  {'max_queue_size', int_arg(ARGV[REST + 3], 0, MAX_QUEUE_SIZE)},
  {'only_if_absent', (ARGV[REST + 4] == '0' or ARGV[REST + 4] == '1') or nil},
  {'drain_gap_us', int_arg(ARGV[REST + 5], 1, MAX_WAIT_US)},
  {'queue_timeout_us', int_arg(ARGV[REST + 6], 1, MAX_WAIT_US)},
  {'aging_us', int_arg(ARGV[REST + 7], 0, MAX_WAIT_US)},
  {'level max_queue_size', int_arg(ARGV[REST + 8], 0, MAX_QUEUE_SIZE)},
  {'demote_after_us', int_arg(ARGV[REST + 9], 0, MAX_WAIT_US)},
  {'slots', int_arg(ARGV[REST + 10], 1, MAX_LEASE_SLOTS)},
  {'tenant', tenant_arg(ARGV[REST + 11])},
  {'weight', int_arg(ARGV[REST + 12], 1, MAX_WEIGHT)},
  {'deadline_gap_us', ARGV[REST + 13] == nil and 0 or int_arg(ARGV[REST + 13], 0, MAX_WAIT_US)},
}
for _, check in ipairs(checks) do
  if check[2] == nil then return {'invalid', check[1]} end
end
local priority, timeout_us, max_size = checks[2][2], checks[3][2], checks[4][2]
local drain_gap_us, max_promise_us = checks[6][2], checks[7][2]
local aging_us, level_max = checks[8][2], checks[9][2]
local demote_us, slots = checks[10][2], checks[11][2]
local tenant, weight = checks[12][2], checks[13][2]
local deadline_gap_us = checks[14][2]
local level = int(priority)
local now = now_us()
if ARGV[REST + 4] == '1' and (redis.call('ZSCORE', K_QUEUE, rid)
    or redis.call('ZSCORE', K_LEASES, rid)) then
  EPOCH_ID = check_epoch(now)
  return result('ok', 0)
end
-- No ready engine has that many slots: refused at once, nothing written.
if #OFFERS > 0 and slots > MOST_SLOTS then
  EPOCH_ID = check_epoch(now)
  return result('unfit', 0)
end
-- Fast path: nobody waits and a slot is free: the lease at once, no queue entry to write.
if redis.call('ZCARD', K_QUEUE) == 0 then
  EPOCH_ID, READY_AT = check_epoch(now)
  local ep = now >= READY_AT and best_endpoint(slots)
  if ep then
    grant(rid, CALLER, ep.url, slots, now, false)
    touch()
    return result('ok', 0)
  end
end
settle_promises(now)
keep_promise(now)
-- Places ahead of a queued request: the entries of other levels before it in the queue (its
-- rank less the others of its level, all older), and those of its level before it in fair order.
local function predicted_wait(rid, level, gap)
  local others = redis.call('ZRANK', K_QUEUE, rid)
    - (int_value(redis.call('HGET', K_LEVELS, level), 1) - 1)
  local ahead = math.max(0, others) + (redis.call('ZRANK', fairq_key(level), rid) or 0)
  return (math.min(ahead, math.floor(MAX_WAIT_US / gap)) + 1) * gap
end
local seq = redis.call('INCR', K_SEQ)
local deadline = now + timeout_us
-- Aging: a level is worth aging_us of waiting, so no level waits forever behind another.
redis.call('ZADD', K_QUEUE, int(now + priority * aging_us), rid)
redis.call('HSET', K_ENTRIES, rid, CALLER .. '|' .. int(deadline) .. '|' .. int(now) .. '|'
  .. level .. '|' .. int(slots))
count_level(level, 1)
-- Within its level, its place follows its tenant's fair share (fair.py).
local fair_before = fair_add(rid, level, tenant, weight, slots)
redis.call('ZADD', K_DEADLINES, int(deadline), rid)
if demote_us > 0 then redis.call('ZADD', K_DELAYS, int(now + demote_us), rid) end
redis.call('ZADD', waiting_key(CALLER), int(deadline), rid)
redis.call('PEXPIRE', waiting_key(CALLER), STATE_TTL_MS)
redis.call('SADD', K_REPLICAS, CALLER)
local hold = dispatch(now)
touch()
-- The level's own limit (when below the pool's): a flood at one level cannot take the other
-- levels' places. No promise: its Retry-After is the time its level's queue takes to drain.
if level_max < max_size and redis.call('ZSCORE', K_QUEUE, rid)
    and int_value(redis.call('HGET', K_LEVELS, level), 0) > level_max then
  drop(rid)
  fair_undo(level, tenant, fair_before)
  local ahead = int_value(redis.call('HGET', K_LEVELS, level), 0) + 1
  touch()
  return result('level_full', 0, math.ceil(
    math.min(ahead * drain_gap_us, max_promise_us) / 1000000) * 1000000)
end
-- Deadline-aware refusal: a request whose predicted wait is longer than it may wait is refused
-- now, never timed out after holding a place (types.predicted_wait_us).
if deadline_gap_us > 0 and redis.call('ZSCORE', K_QUEUE, rid) then
  local wait = predicted_wait(rid, level, deadline_gap_us)
  if wait > timeout_us then
    drop(rid)
    fair_undo(level, tenant, fair_before)
    touch()
    return result('deadline', 0, math.ceil((wait - timeout_us) / 1000000) * 1000000)
  end
end
-- A free slot takes anyone; a newcomer that has to wait may not take a place held for a
-- promised client.
if redis.call('ZSCORE', K_QUEUE, rid) and redis.call('ZCARD', K_QUEUE) + HELD > max_size then
  drop(rid)
  fair_undo(level, tenant, fair_before)
  -- Honest: never later than the drain, at the measured gap, of all that is ahead of it: the
  -- queue and the live promises in the share kept (lapsed ones, their clients gone, count no
  -- more and make the rest count less). With every client back it is the horizon itself.
  local ahead = redis.call('ZCARD', K_QUEUE) + kept_share(redis.call('ZCARD', K_RETRIES))
  ahead = math.min(ahead, math.floor(MAX_WAIT_US / drain_gap_us) + 1)
  local last = math.min(stat('retry_horizon'), now + ahead * drain_gap_us)
  if last - now >= max_promise_us then
    -- Promises reach at most one queue timeout ahead (clients that ignore Retry-After must
    -- not push everyone's further out): come back when the promised ones are due.
    touch()
    return result('full', 0, math.ceil((last - now) / 1000000) * 1000000)
  end
  -- The next free place after every place already promised: whole seconds, as the client
  -- will wait (Retry-After has one-second resolution).
  local horizon = math.max(now, last) + drain_gap_us
  redis.call('HSET', K_STATS, 'retry_horizon', int(horizon))
  local retry_us = math.ceil((horizon - now) / 1000000) * 1000000
  redis.call('ZADD', K_RETRIES, int(now + retry_us), seq)
  touch()
  return result('full', 0, retry_us)
end
return result('ok', hold)
"""
)

RELEASE = (
    _PRELUDE
    + r"""
if INVALID then return {'invalid', INVALID} end
for i = REST, #ARGV do release_lease(ARGV[i]) end
local hold = dispatch(now_us())
touch()
return result('ok', hold)
"""
)

CANCEL = (
    _PRELUDE
    + r"""
if INVALID then return {'invalid', INVALID} end
local rid = ARGV[REST] or ''

if redis.call('ZSCORE', K_QUEUE, rid) then
  drop(rid)
  return {'cancelled', ''}
end
drop(rid)
local ep = redis.call('HGET', K_LEASE_EP, rid)
if ep then return {'granted', ep} end
return {'gone', ''}
"""
)

TICK = (
    _PRELUDE
    + r"""
if INVALID then return {'invalid', INVALID} end
local now = now_us()
local expired = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, SWEEP_BATCH)
for _, rid in ipairs(expired) do release_lease(rid) end
drop_many(redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', now, 'LIMIT', 0, SWEEP_BATCH))
demote(redis.call('ZRANGEBYSCORE', K_DELAYS, '-inf', now, 'LIMIT', 0, SWEEP_BATCH))
-- Dead replicas' entries, a batch per dead replica (the set holds one member per replica).
for _, replica in ipairs(redis.call('SMEMBERS', K_REPLICAS)) do
  local wk = waiting_key(replica)
  if not is_alive(replica) then drop_many(redis.call('ZRANGE', wk, 0, SWEEP_BATCH - 1)) end
  if redis.call('EXISTS', wk) == 0 then redis.call('SREM', K_REPLICAS, replica) end
end
local hold = dispatch(now)
touch()
return result('ok', hold)
"""
)

SCRIPTS: dict[str, str] = {
    "enqueue": ENQUEUE,
    "release": RELEASE,
    "cancel": CANCEL,
    "tick": TICK,
    "heartbeat": HEARTBEAT,
}
