"""How the Lua scripts read and write numbers (see ``scripts.py``): exactly, and checked first.

Redis runs Lua 5.1, whose numbers are doubles: ``..`` writes them with ``%.14g`` (``10^14``
becomes ``1e+14``), Redis turns a number argument of ``redis.call`` into text with ``%.17g``
(``1e+17``), and ``tonumber`` takes ``nan``, ``inf``, hex and exponents. So every number a script
writes goes through ``int`` (``string.format('%d')``: the digits, always), and every number it
reads from ARGV goes through ``int_arg`` (digits only, in bounds; anything else is refused before
the script's first write), so no value a caller passes can become an entry that a later script
cannot read. Values a script reads back from Redis are parsed the same strict way.
"""

from __future__ import annotations

from slotserve.gateway.admission.types import MAX_LEASE_SLOTS, MAX_QUEUE_SIZE, MAX_WAIT_US
from slotserve.gateway.pools.routing import (
    MAX_OFFER_AGE_MS,
    MAX_OFFER_ROW_IDLE_MS,
    MAX_OFFER_ROWS,
    MAX_OFFER_SLOTS,
)

VALUES = (
    f"""
local MAX_WAIT_US, MAX_QUEUE_SIZE = {MAX_WAIT_US}, {MAX_QUEUE_SIZE}
local MAX_LEASE_SLOTS, MAX_OFFER_SLOTS = {MAX_LEASE_SLOTS}, {MAX_OFFER_SLOTS}
local MAX_OFFER_ROWS, MAX_OFFER_ROW_IDLE_MS = {MAX_OFFER_ROWS}, {MAX_OFFER_ROW_IDLE_MS}
local MAX_OFFER_AGE_MS = {MAX_OFFER_AGE_MS}
"""
    + r"""
-- An integer as its digits (never an exponent): what every script writes.
local function int(n) return string.format('%d', n) end

-- ARGV text that is an integer in [lo, hi] (digits only, at most 16), else nil.
local function int_arg(s, lo, hi)
  if type(s) ~= 'string' or #s > 16 or not string.match(s, '^%-?%d+$') then return nil end
  local n = tonumber(s)
  if n < lo or n > hi then return nil end
  return n
end

-- ARGV text that is a finite number (an engine's load score), else nil.
local function finite_arg(s)
  if type(s) ~= 'string' or #s > 32 then return nil end
  local n = tonumber(s)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end

-- ARGV text usable as a name inside keys and grant items: non-empty, no \31 (the separator).
local function name_arg(s)
  if type(s) ~= 'string' or s == '' or #s > 512 or string.find(s, '\31', 1, true) then
    return nil
  end
  return s
end

-- An integer field read back from Redis (absent or unreadable: the default).
local function int_value(s, default)
  if type(s) ~= 'string' or #s > 16 or not string.match(s, '^%-?%d+$') then return default end
  return tonumber(s)
end
"""
)
