"""Preemption for a tenant under its share, in the dispatching scripts (see ``scripts.py``).

``preempt_share.py`` is the in-process twin and says the rule; this is the same rule, step for
step. Per-tenant held slots are kept with the leases (``slots.py``'s ``grant`` and
``release_lease``): ``P:{pool}:tenant_held`` (tenant -> slots held in the pool),
``P:{pool}:tenant_held_at`` (tenant \\31 URL -> slots held on that engine) and
``P:{pool}:lease_tenants`` (request id -> tenant); ``P:{pool}:tenant_weights`` (tenant -> weight,
written at enqueue) and ``P:{pool}:entry_tenants`` (a waiting request's tenant).

Needs the prelude's keys, ``OFFERS``, ``int``/``int_value``, ``parse_entry``, ``is_alive``,
``DEMOTION_OFFSET`` and ``fair.py``'s ``fair_key``, ``fairq_key``, ``FAIR_UNIT`` and ``V_FIELD``.
"""

from __future__ import annotations

from slotserve.gateway.admission.preempt_share import PREEMPT_MARK, PREEMPT_SCAN

assert PREEMPT_MARK == "\x1e", "the Lua below writes it as '\\30'"

PREEMPT = (
    f"""
local PREEMPT_SCAN = {PREEMPT_SCAN}
"""
    + r"""
local function tenant_weight(t)
  local w = int_value(redis.call('HGET', K_TENANT_WEIGHTS, t), 1)
  if w < 1 or w > MAX_WEIGHT then return 1 end
  return w
end

local function count_held(tenant, url, delta)
  if redis.call('HINCRBY', K_TENANT_HELD, tenant, int(delta)) <= 0 then
    redis.call('HDEL', K_TENANT_HELD, tenant)
  end
  local at = tenant .. '\31' .. url
  if redis.call('HINCRBY', K_TENANT_HELD_AT, at, int(delta)) <= 0 then
    redis.call('HDEL', K_TENANT_HELD_AT, at)
  end
end

-- preempt_share.max_outstanding
local function max_outstanding(slots) return math.max(1, math.floor(slots / 2)) end

-- preempt_share.pick_preemption: the offer and the victim tenant, or nil. ``level``: the
-- request's level (its fair state says who is backlogged there).
local function pick_preemption(tenant, level)
  local total, flat = 0, redis.call('HGETALL', K_TENANT_HELD)
  for _, o in ipairs(OFFERS) do total = total + o.slots end
  local held, weight, holding, total_weight = {}, {}, {}, 0
  for i = 1, #flat, 2 do
    local n = int_value(flat[i + 1], 0)
    if n > 0 then
      holding[#holding + 1] = flat[i]
      held[flat[i]], weight[flat[i]] = n, tenant_weight(flat[i])
      total_weight = total_weight + weight[flat[i]]
    end
  end
  if not held[tenant] then
    held[tenant], weight[tenant] = 0, tenant_weight(tenant)
    total_weight = total_weight + weight[tenant]
  end
  local backlog_bound = math.floor(FAIR_UNIT * total / total_weight)
  local fk = level and fair_key(level)  -- no level (an entry from before): nobody backlogged
  local virtual_time = fk and int_value(redis.call('HGET', fk, V_FIELD), 0)
  local function excess(t) return held[t] * total_weight - total * weight[t] end
  local function backlogged(t)
    if fk == nil then return false end
    local lead = int_value(redis.call('HGET', fk, t), 0) - virtual_time
    return lead > backlog_bound + math.floor(FAIR_UNIT / weight[t])
  end
  local light = not backlogged(tenant)
  local reclaim = excess(tenant) < 0
  local borrow = light and excess(tenant) <= 0
  if not (reclaim or borrow) then return nil end
  local function may_take(t)
    local over = excess(t)
    if reclaim and over > 0 and (light or over > total_weight) then return true end
    return borrow and over >= 0 and backlogged(t)
  end
  local function more_over(a, b)
    local left, right = held[a] * weight[b], held[b] * weight[a]
    return left > right or (left == right and a < b)
  end
  local victims = {}
  for _, t in ipairs(holding) do
    if t ~= tenant and may_take(t) then victims[#victims + 1] = t end
  end
  if #victims == 0 then return nil end
  local best, best_victim, best_outstanding = nil, nil, nil
  for _, o in ipairs(OFFERS) do
    local outstanding = tonumber(redis.call('HGET', K_INFLIGHT, o.url) or '0') - o.slots
    if outstanding >= 0 and outstanding < max_outstanding(o.slots) then
      local victim = nil
      for _, t in ipairs(victims) do
        if int_value(redis.call('HGET', K_TENANT_HELD_AT, t .. '\31' .. o.url), 0) > outstanding
            and (victim == nil or more_over(t, victim)) then
          victim = t
        end
      end
      if victim and (best == nil or outstanding < best_outstanding
          or (outstanding == best_outstanding and (o.load < best.load
            or (o.load == best.load and o.url < best.url)))) then
        best, best_victim, best_outstanding = o, victim, outstanding
      end
    end
  end
  return best, best_victim
end

-- The twin of backends/memory_steps.preemptor_behind: when the head may not preempt, the first
-- of its level's first PREEMPT_SCAN entries in fair order whose tenant may (each tenant judged
-- by its first live one-slot entry there): rid, replica, tag, offer, victim, tenant; or nil.
local function preemptor_behind(head_tenant, level, now)
  local tried = {}
  if head_tenant then tried[head_tenant] = true end
  local f = redis.call('ZRANGE', fairq_key(level), 0, PREEMPT_SCAN - 1, 'WITHSCORES')
  for i = 1, #f, 2 do
    local rid, tag = f[i], tonumber(f[i + 1])
    local info = redis.call('HGET', K_ENTRIES, rid)
    local t = redis.call('HGET', K_ENTRY_TENANTS, rid)
    if info and t and not tried[t] then
      local replica, deadline, _, _, slots = parse_entry(info)
      local due = tonumber(redis.call('ZSCORE', K_DELAYS, rid) or '-1')
      if slots == 1 and tag < DEMOTION_OFFSET and (due < 0 or due > now)
          and replica and deadline > now and is_alive(replica) then
        tried[t] = true
        local ep, victim = pick_preemption(t, level)
        if ep then return rid, replica, tag, ep, victim, t end
      end
    end
  end
  return nil
end
"""
)
