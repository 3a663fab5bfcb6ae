"""Prefix-aware routing inside the dispatching scripts (see ``scripts.py``): ``pools/routing.py``'s
``pick_endpoint`` in Lua, and the records it reads and writes.

A request's route (``routing.Route.encode``: balance per mille, session hash, url/depth pairs of
the engines whose /load matched its prefix keys, the keys) comes with its enqueue; a request
that waits keeps it in ``P:{pool}:routes`` until it is granted or dropped. When it is granted,
the engines' matches are joined by the recent routings (``P:{pool}:routed:{key}``: each of its
keys routed to an engine in the last ``ROUTED_TTL_MS`` counts its depth there), the deepest
within the balance wins, else its session's engine (``P:{pool}:session:{id}``) within the
balance, else the least loaded; then its first and deepest keys and its session are recorded
for the engine chosen.

A route that does not read is no route (never an error): a route only prefers among the engines
that have room, so no value in it can put a request on a full engine. The in-process twin is
``backends/memory_routes.py``. Needs ``values.py``, ``PREFIX``, ``POOL`` and ``K_ROUTES``.
"""

from __future__ import annotations

from slotserve.contracts.prefix_keys import MAX_PREFIX_KEYS
from slotserve.contracts.redis_keys import Keys, lua_expr, lua_key
from slotserve.gateway.pools.routing import (
    MAX_ROUTE_CHARS,
    MAX_ROUTE_DEPTHS,
    ROUTED_TTL_MS,
    SESSION_HEX,
    SESSION_TTL_MS,
)

_KEYS, _POOL = Keys(lua_expr("PREFIX")), lua_expr("POOL")

ROUTES = (
    f"""
local ROUTED_TTL_MS, SESSION_TTL_MS = {ROUTED_TTL_MS}, {SESSION_TTL_MS}
local MAX_ROUTE_CHARS, MAX_ROUTE_DEPTHS = {MAX_ROUTE_CHARS}, {MAX_ROUTE_DEPTHS}
local MAX_PREFIX_KEYS, SESSION_HEX = {MAX_PREFIX_KEYS}, {SESSION_HEX}
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

local function split_items(text)
  local out = {}
  if text == '' then return out end
  for item in string.gmatch(text .. '\31', '([^\31]*)\31') do out[#out + 1] = item end
  return out
end

-- routing.Route.encode's text as a table (nil: none, or it does not read).
local function decode_route(text)
  if type(text) ~= 'string' or text == '' or #text > MAX_ROUTE_CHARS then return nil end
  local fields = {}
  for field in string.gmatch(text .. '\30', '([^\30]*)\30') do fields[#fields + 1] = field end
  if #fields ~= 4 then return nil end
  local balance = int_value(fields[1], nil)
  if not balance or balance < 0 or balance > 1000 then return nil end
  local session = fields[2]
  if #session > SESSION_HEX or not string.match(session, '^[0-9a-f]*$') then return nil end
  local route = {balance = balance, session = session, depths = {}, keys = {}}
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
local function route_granted(route, url)
  local n = #route.keys
  if n > 0 then redis.call('SET', routed_key(route.keys[1]), url, 'PX', ROUTED_TTL_MS) end
  if n > 1 then redis.call('SET', routed_key(route.keys[n]), url, 'PX', ROUTED_TTL_MS) end
  if route.session ~= '' then
    redis.call('SET', session_key(route.session), url, 'PX', SESSION_TTL_MS)
  end
end

-- routing.pick_endpoint among the endpoints with room (`eligible`, `least` the least loaded;
-- `better` orders them as rank_endpoints does); records the route for the one chosen.
local function pick_routed(least, eligible, route, better)
  local function balanced(c)
    return (c.used * least.slots - least.used * c.slots) * 1000
      <= route.balance * c.slots * least.slots
  end
  local depths = route_depths(route)
  local pick, depth = nil, 0
  for _, c in ipairs(eligible) do
    local d = depths[c.url] or 0
    if d > 0 and balanced(c) and (d > depth or (d == depth and better(c, pick))) then
      pick, depth = c, d
    end
  end
  if not pick and route.session ~= '' then
    local url = redis.call('GET', session_key(route.session))
    for _, c in ipairs(eligible) do
      if url and c.url == url and balanced(c) then pick = c end
    end
  end
  pick = pick or least
  route_granted(route, pick.url)
  return pick
end
"""
)
