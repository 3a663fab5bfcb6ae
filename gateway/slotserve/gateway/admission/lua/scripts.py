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
then N offers (url, slots_total, load_score, rows_free), then the script's own arguments: one
dataclass per script (``args.py``, ``SCRIPT_ARGS``) whose fields the script reads as ``ARG_*``
locals.
Each reply is parsed by ``replies.py``. The batching policy and its delay do not reach Redis:
the engine forms batches.

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

from slotserve.contracts.redis_keys import ScriptArgs
from slotserve.gateway.admission.lua.args import (
    CancelArgs,
    EnqueueArgs,
    HeartbeatArgs,
    ReleaseArgs,
    TickArgs,
)
from slotserve.gateway.admission.lua.epoch import HEARTBEAT
from slotserve.gateway.admission.lua.prelude import PRELUDE

# Its arguments: ``args.EnqueueArgs`` (``deadline_gap_us`` or ``route`` absent, from an older
# gateway: none).
ENQUEUE = (
    PRELUDE
    + EnqueueArgs.lua_args("REST")
    + r"""
if INVALID then return {'invalid', INVALID} end
-- Every argument is checked before the first write (types.check_enqueue's bounds).
local rid = name_arg(ARG_REQUEST_ID)
local priority = int_arg(ARG_PRIORITY, 0, MAX_LEVEL)
local timeout_us = int_arg(ARG_TIMEOUT_US, 1, MAX_WAIT_US)
local max_size = int_arg(ARG_MAX_QUEUE_SIZE, 0, MAX_QUEUE_SIZE)
local only_if_absent = (ARG_ONLY_IF_ABSENT == '0' or ARG_ONLY_IF_ABSENT == '1') or nil
local drain_gap_us = int_arg(ARG_DRAIN_GAP_US, 1, MAX_WAIT_US)
local max_promise_us = int_arg(ARG_QUEUE_TIMEOUT_US, 1, MAX_WAIT_US)
local aging_us = int_arg(ARG_AGING_US, 0, MAX_WAIT_US)
local level_max = int_arg(ARG_LEVEL_MAX_QUEUE_SIZE, 0, MAX_QUEUE_SIZE)
local demote_us = int_arg(ARG_DEMOTE_AFTER_US, 0, MAX_WAIT_US)
local slots = int_arg(ARG_SLOTS, 1, MAX_LEASE_SLOTS)
local tenant = tenant_arg(ARG_TENANT)
local weight = int_arg(ARG_WEIGHT, 1, MAX_WEIGHT)
local deadline_gap_us = ARG_DEADLINE_GAP_US == nil and 0
  or int_arg(ARG_DEADLINE_GAP_US, 0, MAX_WAIT_US)
-- Its route (routes.py): bounded here; one that does not read is none.
local route_ok = (ARG_ROUTE == nil or #ARG_ROUTE <= MAX_ROUTE_CHARS) or nil
local route = decode_route(ARG_ROUTE)
-- The first that does not hold is named (nil: refused), in argument order.
for _, check in ipairs({
  {'request id', rid}, {'priority', priority}, {'timeout_us', timeout_us},
  {'max_queue_size', max_size}, {'only_if_absent', only_if_absent},
  {'drain_gap_us', drain_gap_us}, {'queue_timeout_us', max_promise_us},
  {'aging_us', aging_us}, {'level max_queue_size', level_max},
  {'demote_after_us', demote_us}, {'slots', slots}, {'tenant', tenant}, {'weight', weight},
  {'deadline_gap_us', deadline_gap_us}, {'route', route_ok},
}) do
  if check[2] == nil then return {'invalid', check[1]} end
end
local level = int(priority)
local now = now_us()
redis.call('HSET', K_TENANT_WEIGHTS, tenant, int(weight))  -- for the share (preempt.py)
redis.call('PEXPIRE', K_TENANT_WEIGHTS, STATE_TTL_MS)
if ARG_ONLY_IF_ABSENT == '1' and (redis.call('ZSCORE', K_QUEUE, rid)
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
  -- A request that would wait for its engine (routes.py) queues instead.
  local ep = now >= READY_AT and best_endpoint(slots, route, nil, now)
  if ep then
    grant(rid, CALLER, ep.url, slots, now, false, tenant)
    if route then route_granted(route, ep.url, rid, now) end
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
redis.call('HSET', K_ENTRY_TENANTS, rid, tenant)
count_level(level, 1)
-- Within its level, its place follows its tenant's fair share (fair.py).
local fair_before = fair_add(rid, level, tenant, weight, slots)
redis.call('ZADD', K_DEADLINES, int(deadline), rid)
if route then redis.call('HSET', K_ROUTES, rid, ARG_ROUTE) end
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
    + ReleaseArgs.lua_args("REST")
    + r"""
if INVALID then return {'invalid', INVALID} end
for i = ARG_REQUEST_IDS_AT, #ARGV do release_lease(ARGV[i]) end
local hold = dispatch(now_us())
touch()
return result('ok', hold)
"""
)

CANCEL = (
    PRELUDE
    + CancelArgs.lua_args("REST")
    + r"""
if INVALID then return {'invalid', INVALID} end
local rid = ARG_REQUEST_ID or ''

if redis.call('ZSCORE', K_QUEUE, rid) then
  drop(rid)
  return {'cancelled', ''}
end
drop(rid)
local ep = redis.call('HGET', K_LEASE_ENDPOINT, rid)
if ep then return {'granted', ep} end
return {'gone', ''}
"""
)

TICK = (
    PRELUDE
    + TickArgs.lua_args("REST")
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
SCRIPT_ARGS: dict[str, type[ScriptArgs]] = {
    "enqueue": EnqueueArgs,
    "release": ReleaseArgs,
    "cancel": CancelArgs,
    "tick": TickArgs,
    "heartbeat": HeartbeatArgs,
}
