"""Prefix-aware routing inside the dispatching scripts (see ``scripts.py``): ``pools/routing.py``'s
``pick_endpoint`` in Lua, and the records it reads and writes.

A request's route (``routing.Route.encode``: balance per mille, session hash, url/depth pairs of
the engines whose /load matched its prefix keys, the keys) comes with its enqueue; a request
that waits keeps it in ``P:{pool}:routes`` until it is granted or dropped. When it is granted,
the engines' matches are joined by the recent routings (``P:{pool}:routed:{key}``: each of its
keys routed to an engine in the last ``ROUTED_TTL_MS`` counts its depth there), the deepest
within the balance wins, else its session's engine (``P:{pool}:session:{id}``) within the
balance, else the coldest (``routing.coldness``: the most empty rows, then the row unused
longest, the offers' ``rows`` and ``idle`` less the rows claimed since each report) within the
balance, else the least loaded; then its first and deepest keys and its session are recorded
for the engine chosen, and a row claim where it matched nothing (``route_granted``, by the step
that grants).

A route that may wait (``Route.may_wait``) and whose engines holding its deepest match (none: its
session's engine; no session: ``routing.coldest_full``) are all full waits for them
(``routing.waits_for_engine``) until an engine's room has gone unused for its ``wait_ms``
(``P:{pool}:route_waits``'s ``=room``: set by a dispatch step that ends with a waiting head
that nobody behind could pass, cleared by one that ends with no room left or nobody waiting);
``cache_wait.py`` lets the requests behind it take the room meanwhile.

A route that does not read is no route (never an error): a route only prefers among the engines
that have room, so no value in it can put a request on a full engine. The in-process twin is
``backends/memory_routes.py``. Needs ``values.py``, ``PREFIX``, ``POOL`` and ``K_ROUTES``.
"""

from __future__ import annotations

from slotserve.contracts.prefix_keys import MAX_PREFIX_KEYS
from slotserve.contracts.redis_keys import Keys, lua_expr, lua_key
from slotserve.gateway.pools.routing import (
    COLDER_BY_MS,
    MAX_CACHE_WAIT_MS,
    MAX_LOOK_AHEAD,
    MAX_ROUTE_CHARS,
    MAX_ROUTE_DEPTHS,
    ROUTED_TTL_MS,
    ROW_CLAIM_MARGIN_MS,
    ROW_CLAIM_TTL_MS,
    SESSION_HEX,
    SESSION_TTL_MS,
)

_KEYS, _POOL = Keys(lua_expr("PREFIX")), lua_expr("POOL")

ROUTES = (
    f"""
local ROUTED_TTL_MS, SESSION_TTL_MS = {ROUTED_TTL_MS}, {SESSION_TTL_MS}
local MAX_ROUTE_CHARS, MAX_ROUTE_DEPTHS = {MAX_ROUTE_CHARS}, {MAX_ROUTE_DEPTHS}
local MAX_PREFIX_KEYS, SESSION_HEX = {MAX_PREFIX_KEYS}, {SESSION_HEX}
local MAX_CACHE_WAIT_MS, MAX_LOOK_AHEAD = {MAX_CACHE_WAIT_MS}, {MAX_LOOK_AHEAD}
local ROW_CLAIM_MARGIN_MS, ROW_CLAIM_TTL_MS = {ROW_CLAIM_MARGIN_MS}, {ROW_CLAIM_TTL_MS}
local COLDER_BY_MS = {COLDER_BY_MS}
-- route_waits' one field: since when room has gone unused while requests wait (no request id
-- starts with '=': the gateway makes them, hex).
local ROOM_IDLE = '=room'
"""
    + r"""
local function routed_key(key)
  return """
    + lua_key(_KEYS.routed(_POOL, lua_expr("key")))
    + r"""
end

local function session_key(id)
  return """
    + lua_key(_KEYS.session(_POOL, lua_expr("id")))
    + r"""
end

local function claims_key(url)
  return """
    + lua_key(_KEYS.row_claims(_POOL, lua_expr("url")))
    + r"""
end

-- Url -> rows claimed since the offer's report (routing.claim_cutoff_us), read once a script
-- call (its `now` is one moment) and counted up by its own claims.
local CLAIMS = {}
local function claims_since_report(o, now)
  local n = CLAIMS[o.url]
  if n == nil then
    local cutoff = now - (o.age + ROW_CLAIM_MARGIN_MS) * 1000
    n = redis.call('ZCOUNT', claims_key(o.url), '(' .. int(cutoff), '+inf')
    CLAIMS[o.url] = n
  end
  return n
end

-- routing.with_claims: `c`'s rows and idle less what was claimed since its report.
local function claimed(c, o, now)
  local n = claims_since_report(o, now)
  if n > 0 then c.rows, c.idle = math.max(0, o.rows - n), 0 end
  return c
end

-- routing.coldness, compared: is `a` colder than a row count and idle of `rows` and `idle`?
local function colder(a, rows, idle)
  return a.rows > rows or (a.rows == rows and a.idle > idle)
end

local function split_items(text)
  local out = {}
  if text == '' then return out end
  for item in string.gmatch(text .. '\31', '([^\31]*)\31') do out[#out + 1] = item end
  return out
end

-- routing.Route.encode's text as a table (nil: none, or it does not read). Four fields (an
-- older gateway's): it never waits.
local function decode_route(text)
  if type(text) ~= 'string' or text == '' or #text > MAX_ROUTE_CHARS then return nil end
  local fields = {}
  for field in string.gmatch(text .. '\30', '([^\30]*)\30') do fields[#fields + 1] = field end
  if #fields ~= 4 and #fields ~= 6 then return nil end
  local balance = int_value(fields[1], nil)
  if not balance or balance < 0 or balance > 1000 then return nil end
  local session = fields[2]
  if #session > SESSION_HEX or not string.match(session, '^[0-9a-f]*$') then return nil end
  local wait_ms, look_ahead = 0, 0
  if #fields == 6 then
    wait_ms, look_ahead = int_value(fields[5], nil), int_value(fields[6], nil)
    if not wait_ms or wait_ms < 0 or wait_ms > MAX_CACHE_WAIT_MS then return nil end
    if not look_ahead or look_ahead < 0 or look_ahead > MAX_LOOK_AHEAD then return nil end
  end
  local route = {balance = balance, session = session, depths = {}, keys = {},
                 wait_ms = wait_ms, look_ahead = look_ahead}
  local items = split_items(fields[3])
  for i = 1, math.min(#items, 2 * MAX_ROUTE_DEPTHS) - 1, 2 do
    local depth = int_value(items[i + 1], nil)
    if depth and depth > 0 and depth <= MAX_PREFIX_KEYS then route.depths[items[i]] = depth end
  end
  for _, key in ipairs(split_items(fields[4])) do
    if #route.keys >= MAX_PREFIX_KEYS then break end
    if #key == 16 and string.match(key, '^[0-9a-f]+$') then route.keys[#route.keys + 1] = key end
  end
  return route
end

-- Url -> keys matched: the engines' reports, then each key routed lately counts its depth at
-- the engine it went to (memory_routes.RouteMemory.depths).
local function route_depths(route)
  local depths = {}
  for url, depth in pairs(route.depths) do depths[url] = depth end
  if #route.keys > 0 then
    local names = {}
    for i, key in ipairs(route.keys) do names[i] = routed_key(key) end
    local urls = redis.call('MGET', unpack(names))
    for i = 1, #names do
      local url = urls[i]
      if url then depths[url] = math.max(depths[url] or 0, i) end
    end
  end
  return depths
end

-- Its first key (a shared system prompt, a document) and its deepest (the conversation so far):
-- the prefixes a burst shares before the engine's /load shows them (routing.recorded_keys).
local function route_granted(route, url, rid, now)
  if route.new_row then
    local key = claims_key(url)
    redis.call('ZADD', key, int(now), rid)
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now - ROW_CLAIM_TTL_MS * 1000))
    redis.call('PEXPIRE', key, ROW_CLAIM_TTL_MS)
    CLAIMS[url] = (CLAIMS[url] or 0) + 1
  end
  local n = #route.keys
  if n > 0 then redis.call('SET', routed_key(route.keys[1]), url, 'PX', ROUTED_TTL_MS) end
  if n > 1 then redis.call('SET', routed_key(route.keys[n]), url, 'PX', ROUTED_TTL_MS) end
  if route.session ~= '' then
    redis.call('SET', session_key(route.session), url, 'PX', SESSION_TTL_MS)
  end
end

-- routing.coldest_full: the full engines (of `all`) with the most empty rows while none with
-- room for `need` slots has one; with no empty row anywhere, those whose next row to evict sat
-- unused longest, when that is COLDER_BY_MS longer than at any engine with room; else none.
local function coldest_full(all, need)
  local room_idle, most, coldest = 0, 0, 0
  for _, c in ipairs(all) do
    if c.used + need <= c.slots then
      if c.rows > 0 then return {} end
      room_idle = math.max(room_idle, c.idle)
    else
      most, coldest = math.max(most, c.rows), math.max(coldest, c.idle)
    end
  end
  local out = {}
  if most == 0 and coldest <= room_idle + COLDER_BY_MS then return out end
  for _, c in ipairs(all) do
    if c.used + need > c.slots and ((most > 0 and c.rows == most)
        or (most == 0 and c.idle == coldest)) then
      out[#out + 1] = c
    end
  end
  return out
end

-- routing.waits_for_engine: the engines (`all`, every sound offer) holding the deepest match
-- (none: the session's engine, `session()`; no session either: coldest_full) are all full, and
-- one would be within the balance of `least` once `need` slots freed there.
local function waits_for_engine(all, least, route, depths, session, need)
  local deepest = 0
  for _, c in ipairs(all) do deepest = math.max(deepest, depths[c.url] or 0) end
  local holders = {}
  if deepest > 0 then
    for _, c in ipairs(all) do
      if (depths[c.url] or 0) == deepest then holders[#holders + 1] = c end
    end
  else
    local session_url = session()
    if session_url then
      for _, c in ipairs(all) do
        if c.url == session_url then holders[#holders + 1] = c end
      end
    else
      holders = coldest_full(all, need)
    end
  end
  local waits = false
  for _, c in ipairs(holders) do
    if c.used + need <= c.slots then return false end
    if need <= c.slots and ((c.slots - need) * least.slots - least.used * c.slots) * 1000
        <= route.balance * c.slots * least.slots then
      waits = true
    end
  end
  return waits
end

-- routing.pick_endpoint among the endpoints with room (`eligible`, `least` the least loaded;
-- `better` orders them as rank_endpoints does; `all`: every sound offer). Returns it, or nil
-- and true while the request waits for its engine (`rid` nil: the enqueue's fast path asks,
-- and a request that would wait queues instead).
local function pick_routed(least, eligible, all, route, better, need, rid, now)
  local session_url = nil
  local function session()
    if session_url == nil then
      session_url = route.session ~= '' and redis.call('GET', session_key(route.session)) or false
    end
    return session_url
  end
  local depths = route_depths(route)
  if route.wait_ms > 0 and route.look_ahead > 0
      and waits_for_engine(all, least, route, depths, session, need) then
    if rid == nil then return nil, true end
    -- It waits until an engine's room has gone unused for its wait_ms (memory_steps.cache_waits).
    local since = int_value(redis.call('HGET', K_ROUTE_WAITS, ROOM_IDLE), nil)
    if since == nil or now - since < route.wait_ms * 1000 then return nil, true end
  end
  local function balanced(c)
    return (c.used * least.slots - least.used * c.slots) * 1000
      <= route.balance * c.slots * least.slots
  end
  local pick, depth = nil, 0
  for _, c in ipairs(eligible) do
    local d = depths[c.url] or 0
    if d > 0 and balanced(c) and (d > depth or (d == depth and better(c, pick))) then
      pick, depth = c, d
    end
  end
  if not pick and route.session ~= '' then
    local url = session()
    for _, c in ipairs(eligible) do
      if url and c.url == url and balanced(c) then pick = c end
    end
  end
  if not pick then
    local rows, idle = 0, 0
    for _, c in ipairs(eligible) do
      if balanced(c) and (colder(c, rows, idle)
          or (pick and c.rows == rows and c.idle == idle and better(c, pick))) then
        pick, rows, idle = c, c.rows, c.idle
      end
    end
  end
  pick = pick or least
  route.new_row = (depths[pick.url] or 0) == 0
  return pick, false
end
"""
)
