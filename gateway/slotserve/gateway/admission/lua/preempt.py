"""Preemption for a tenant under its share, in the dispatching scripts (see ``scripts.py``).

``preempt_share.py`` is the in-process twin and says the rule; this is the same rule, step for
step. Per-tenant held slots are kept with the leases (``slots.py``'s ``grant`` and
``release_lease``): ``P:{pool}:tenant_held`` (tenant -> slots held in the pool),
``P:{pool}:tenant_held_at`` (tenant \\31 URL -> slots held on that engine) and
``P:{pool}:lease_tenants`` (request id -> tenant); ``P:{pool}:tenant_weights`` (tenant -> weight,
written at enqueue) and ``P:{pool}:entry_tenants`` (a waiting request's tenant).

Needs the prelude's keys, ``OFFERS``, ``int``/``int_value``.
"""

from __future__ import annotations

from slotserve.gateway.admission.preempt_share import PREEMPT_MARK

assert PREEMPT_MARK == "\x1e", "the Lua below writes it as '\\30'"

PREEMPT = r"""
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

-- preempt_share.pick_preemption: the offer and the victim tenant, or nil.
local function pick_preemption(tenant)
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
  if held[tenant] * total_weight >= total * weight[tenant] then return nil end
  local function more_over(a, b)
    local left, right = held[a] * weight[b], held[b] * weight[a]
    return left > right or (left == right and a < b)
  end
  local best, best_victim = nil, nil
  for _, o in ipairs(OFFERS) do
    if tonumber(redis.call('HGET', K_INFLIGHT, o.url) or '0') == o.slots then
      local victim = nil
      for _, t in ipairs(holding) do
        if t ~= tenant and held[t] * total_weight > total * weight[t]
            and int_value(redis.call('HGET', K_TENANT_HELD_AT, t .. '\31' .. o.url), 0) > 0
            and (victim == nil or more_over(t, victim)) then
          victim = t
        end
      end
      if victim and (best == nil or o.load < best.load
          or (o.load == best.load and o.url < best.url)) then
        best, best_victim = o, victim
      end
    end
  end
  return best, best_victim
end
"""
