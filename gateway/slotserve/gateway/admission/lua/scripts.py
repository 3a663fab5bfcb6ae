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

What every dispatching script starts with (keys, checked arguments, offers, the queue's head,
dispatch, the reply) is ``prelude.py``. The admission epoch and the heartbeat script live in
``epoch.py``; slot accounting (a lease weighs its request's ``n`` slots) in ``slots.py``;
reading and writing numbers in ``values.py``.
"""

from __future__ import annotations

from slotserve.gateway.admission.lua.epoch import HEARTBEAT
from slotserve.gateway.admission.lua.prelude import PRELUDE

# Script arguments after the shared ones: request id, priority, timeout (us), maxQueueSize,
# only-if-absent flag, the expected gap (us) between two places freeing in the queue
# (1 / measured drain rate), how far ahead (us) return times are promised to rejected clients,
# the priority aging step (us of waiting worth one priority level), the level's own
# maxQueueSize, when (us from now) the request is demoted (DELAY; 0: never), the slots it
# takes (its ``n``), its tenant's name and weight (``fair.py``), and the gap (us) that predicts
# its wait for a deadline-aware refusal (0 or absent: none).
ENQUEUE = (
    PRELUDE
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
    PRELUDE
    + r"""
if INVALID then return {'invalid', INVALID} end
for i = REST, #ARGV do release_lease(ARGV[i]) end
local hold = dispatch(now_us())
touch()
return result('ok', hold)
"""
)

CANCEL = (
    PRELUDE
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
    PRELUDE
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
