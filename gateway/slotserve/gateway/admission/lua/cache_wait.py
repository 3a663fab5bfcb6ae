"""A head that waits for the engine holding its prefix lets a request behind it pass, in the
dispatching scripts (see ``scripts.py``; the rule is docs/gateway.md's "Waiting for the engine
that holds the prefix").

When the head of the fair order would rather wait for a full engine than go where there is room
(``routes.py``'s ``pick_routed``, ``routing.waits_for_engine``, for at most its route's
``wait_ms``), the next ``look_ahead`` entries of the same priority level, in fair order, are
looked at, and the first that an engine with room can take now is granted: to the engine holding
its own prefix, else by load, unless it too waits for its engine. Entries that cannot be served
now (past their deadline, their replica dead, due for demotion, needing more slots than any
engine has) are left where they are for the head's checks. Serving an entry past the head moves
the level's virtual time to its start tag, as any grant does (``fair.py``), so a tenant that
passed pays for it in its later entries' tags.

Needs the prelude's keys, ``parse_entry``, ``is_alive``, ``MOST_SLOTS``, ``fair.py``,
``slots.py``'s ``best_endpoint`` and ``grant``, and ``routes.py``. The in-process twin is
``backends/memory.py``'s ``pass_head``.
"""

from __future__ import annotations

CACHE_WAIT = r"""
-- Grants the first of the `window` entries after `head_rid` in `level`'s fair order that an
-- engine with room takes now; false when none.
local function pass_head(level, head_rid, window, now)
  if level == nil or window < 1 then return false end
  local ids = redis.call('ZRANGE', fairq_key(level), 0, window, 'WITHSCORES')
  local seen = 0
  for i = 1, #ids - 1, 2 do
    local rid = ids[i]
    if rid ~= head_rid and seen < window then
      seen = seen + 1
      local info = redis.call('HGET', K_ENTRIES, rid)
      local replica, deadline, slots = nil, 0, 0
      if info then
        local parsed = {parse_entry(info)}
        replica, deadline, slots = parsed[1], parsed[2], parsed[5]
      end
      local due = tonumber(redis.call('ZSCORE', K_DELAYS, rid) or '-1')
      if replica and deadline > now and is_alive(replica) and (due < 0 or due > now)
          and slots <= MOST_SLOTS then
        local route = decode_route(redis.call('HGET', K_ROUTES, rid))
        local ep = best_endpoint(slots, route, rid, now)
        if ep then
          fair_served(level, tonumber(ids[i + 1]))
          grant(rid, replica, ep.url, slots, now, true,
            redis.call('HGET', K_ENTRY_TENANTS, rid) or nil)
          if route then route_granted(route, ep.url, rid, now) end
          return true
        end
      end
    end
  end
  return false
end
"""
