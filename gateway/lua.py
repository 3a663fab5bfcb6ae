"""The named Lua scripts: every check-then-act of the Redis backend is one of these.

They mirror ``memory_backend.InProcessHub`` step for step (same ranking, same group rule, same
queue-full check), so both backends pass the same test suite. Key order: ``keys.POOL_KEY_NAMES``.

Dispatching scripts share one argument layout:
ARGV[1] prefix, [2] pool, [3] calling replica, [4] lease TTL (us), [5] state TTL (ms),
[6] batching policy, [7] maxQueueDelay (us), [8] preferred batch sizes ("4,8"), [9] number of
endpoint offers N, then N triples (url, slots_total, load_score), then the script's own arguments.
"""

from __future__ import annotations

_PRELUDE = r"""
local K_QUEUE, K_ENTRIES, K_SEQ, K_LEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LEASE_EP, K_INFLIGHT, K_STATS = KEYS[5], KEYS[6], KEYS[7]
local PREFIX, POOL, CALLER = ARGV[1], ARGV[2], ARGV[3]
local LEASE_TTL_US = tonumber(ARGV[4])
local STATE_TTL_MS = tonumber(ARGV[5])
local POLICY = ARGV[6]
local MAX_DELAY_US = tonumber(ARGV[7])
local PREFERRED = {}
for size in string.gmatch(ARGV[8], '%d+') do PREFERRED[#PREFERRED + 1] = tonumber(size) end
local NUM_OFFERS = tonumber(ARGV[9])
local OFFERS = {}
for i = 0, NUM_OFFERS - 1 do
  local b = 10 + i * 3
  OFFERS[#OFFERS + 1] = {url = ARGV[b], slots = tonumber(ARGV[b + 1]), load = tonumber(ARGV[b + 2])}
end
local REST = 10 + NUM_OFFERS * 3

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function fmt(n) return string.format('%.0f', n) end

local function drop(rid)
  redis.call('ZREM', K_QUEUE, rid)
  redis.call('HDEL', K_ENTRIES, rid)
end

local function parse_entry(info)
  local replica, deadline, enqueued = string.match(info, '^(.*)|(%d+)|(%d+)$')
  return replica, tonumber(deadline), tonumber(enqueued)
end

-- The oldest live entry of the best priority; expired or orphaned heads are dropped on the way.
local function head(now)
  while true do
    local h = redis.call('ZRANGE', K_QUEUE, 0, 0)
    if #h == 0 then return nil end
    local info = redis.call('HGET', K_ENTRIES, h[1])
    if info then
      local replica, deadline, enqueued = parse_entry(info)
      if deadline > now then return h[1], replica, enqueued end
    end
    drop(h[1])
  end
end

-- routing.rank_endpoints: free slot, lowest held share, then engine load, then URL.
local function best_endpoint(idle_only)
  local best = nil
  for _, o in ipairs(OFFERS) do
    local used = tonumber(redis.call('HGET', K_INFLIGHT, o.url) or '0')
    if used < o.slots and (not idle_only or used == 0) then
      local ratio = used / o.slots
      if best == nil or ratio < best.ratio
          or (ratio == best.ratio and (o.load < best.load
              or (o.load == best.load and o.url < best.url))) then
        best = {url = o.url, slots = o.slots, load = o.load, ratio = ratio}
      end
    end
  end
  return best
end

local function release_lease(rid)
  if redis.call('ZREM', K_LEASES, rid) == 0 then return false end
  local ep = redis.call('HGET', K_LEASE_EP, rid)
  redis.call('HDEL', K_LEASE_EP, rid)
  if ep and redis.call('HINCRBY', K_INFLIGHT, ep, -1) <= 0 then
    redis.call('HDEL', K_INFLIGHT, ep)
  end
  return true
end

local mine = {}

local function grant(rid, replica, url, now)
  drop(rid)
  redis.call('ZADD', K_LEASES, now + LEASE_TTL_US, rid)
  redis.call('HSET', K_LEASE_EP, rid, url)
  redis.call('HINCRBY', K_INFLIGHT, url, 1)
  redis.call('HINCRBY', K_STATS, 'dispatched', 1)
  if replica == CALLER then
    mine[#mine + 1] = rid
    mine[#mine + 1] = url
  else
    local gk = PREFIX .. ':grants:' .. replica
    redis.call('RPUSH', gk, POOL .. '\31' .. rid .. '\31' .. url)
    redis.call('PEXPIRE', gk, math.floor(LEASE_TTL_US / 1000))
  end
end

-- routing.group_size
local function group_size(n, slots, waited)
  if n <= 0 then return 0 end
  if n >= slots then return slots end
  local best = 0
  for _, size in ipairs(PREFERRED) do
    if size <= n and size > best then best = size end
  end
  if best > 0 then return best end
  if waited >= MAX_DELAY_US then return n end
  return 0
end

local function dispatch(now)
  local idle_only = POLICY ~= 'continuous'
  while true do
    local rid, replica, enqueued = head(now)
    if not rid then return 0 end
    local ep = best_endpoint(idle_only)
    if not ep then return 0 end
    if not idle_only then
      grant(rid, replica, ep.url, now)
    else
      local waited = now - enqueued
      local size = group_size(redis.call('ZCARD', K_QUEUE), ep.slots, waited)
      if size == 0 then return math.max(1, MAX_DELAY_US - waited) end
      grant(rid, replica, ep.url, now)
      for _ = 2, size do
        local r2, rep2 = head(now)
        if not r2 then break end
        grant(r2, rep2, ep.url, now)
      end
    end
  end
end

local function touch()
  for i = 1, 7 do redis.call('PEXPIRE', KEYS[i], STATE_TTL_MS) end
end

local function result(status, hold)
  local out = {status, redis.call('ZCARD', K_QUEUE),
               tonumber(redis.call('HGET', K_STATS, 'dispatched') or '0'), hold}
  for _, v in ipairs(mine) do out[#out + 1] = v end
  return out
end
"""

ENQUEUE = (
    _PRELUDE
    + r"""
local rid, priority = ARGV[REST], tonumber(ARGV[REST + 1])
local timeout_us, max_size = tonumber(ARGV[REST + 2]), tonumber(ARGV[REST + 3])
if ARGV[REST + 4] == '1' and (redis.call('ZSCORE', K_QUEUE, rid)
    or redis.call('ZSCORE', K_LEASES, rid)) then
  return result('ok', 0)
end
local now = now_us()
local seq = redis.call('INCR', K_SEQ)
redis.call('ZADD', K_QUEUE, priority * 10000000000000 + seq, rid)
redis.call('HSET', K_ENTRIES, rid, CALLER .. '|' .. fmt(now + timeout_us) .. '|' .. fmt(now))
local hold = dispatch(now)
touch()
if redis.call('ZSCORE', K_QUEUE, rid) and redis.call('ZCARD', K_QUEUE) > max_size then
  drop(rid)
  return result('full', 0)
end
return result('ok', hold)
"""
)

RELEASE = (
    _PRELUDE
    + r"""
for i = REST, #ARGV do release_lease(ARGV[i]) end
local hold = dispatch(now_us())
touch()
return result('ok', hold)
"""
)

CANCEL = (
    _PRELUDE
    + r"""
local rid = ARGV[REST]
if redis.call('ZREM', K_QUEUE, rid) == 1 then
  redis.call('HDEL', K_ENTRIES, rid)
  return {'cancelled', ''}
end
redis.call('HDEL', K_ENTRIES, rid)
local ep = redis.call('HGET', K_LEASE_EP, rid)
if ep then return {'granted', ep} end
return {'gone', ''}
"""
)

TICK = (
    _PRELUDE
    + r"""
local now = now_us()
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now)) do release_lease(rid) end
local alive = {}
local entries = redis.call('HGETALL', K_ENTRIES)
for i = 1, #entries, 2 do
  local replica, deadline = parse_entry(entries[i + 1])
  if alive[replica] == nil then
    alive[replica] = redis.call('EXISTS', PREFIX .. ':replica:' .. replica) == 1
  end
  if not alive[replica] or deadline <= now then drop(entries[i]) end
end
local hold = dispatch(now)
touch()
return result('ok', hold)
"""
)

HEARTBEAT = (
    _PRELUDE
    + r"""
local now = now_us()
local restore = ARGV[REST] == '1'
for i = REST + 1, #ARGV, 2 do
  local rid, ep = ARGV[i], ARGV[i + 1]
  if redis.call('ZSCORE', K_LEASES, rid) then
    redis.call('ZADD', K_LEASES, now + LEASE_TTL_US, rid)
  elseif restore then
    redis.call('ZADD', K_LEASES, now + LEASE_TTL_US, rid)
    redis.call('HSET', K_LEASE_EP, rid, ep)
    redis.call('HINCRBY', K_INFLIGHT, ep, 1)
  end
end
touch()
return {'ok'}
"""
)

SCRIPTS: dict[str, str] = {
    "enqueue": ENQUEUE,
    "release": RELEASE,
    "cancel": CANCEL,
    "tick": TICK,
    "heartbeat": HEARTBEAT,
}
