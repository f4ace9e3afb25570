-- A model's spec, from the packed argument the callers send (`parse_spec`, `spec_of`).
-- Space-separated words (numbers, URLs: an endpoint URL never holds a space).
local function words(s)
  local t = {}
  for word in string.gmatch(s, '%S+') do t[#t + 1] = word end
  return t
end

-- Each tier's way of sharing from its letters, best first ('a', 't' or false for 'f': as
-- `parse_spec`), set as `modes` too: for the scripts given only these (cancel, move),
-- so that an account's entry they write in a tier's index is by that tier's own measure.
local function fair_modes(letters)
  local fair = {}
  for i = 1, #letters do
    local letter = string.sub(letters, i, i)
    fair[i] = letter ~= 'f' and letter
  end
  modes = fair
  return fair
end

-- What pumping needs, in one argument read only when someone waits (an argument costs a
-- script about 170 ns whether read or not), as words (`words`) from index `at`:
-- "claim_ms n ceiling.. fair frac..", the tiers' ceilings best first, then one letter per
-- tier, best first ('a' shares between accounts by their requests, 't' by their tokens, 'f'
-- first come first served), then each tier's share of an endpoint's token budget, then one
-- letter per tier for preemption ('p' may preempt, 'v' may be preempted, '-' neither). The
-- endpoints are not in it: they are in the index (`eps`, `free`). Returns claim_ms, the
-- ceilings, each tier's way of sharing ('a', 't' or false: `modes` too) and the shares
-- (and sets `roles`).
local function parse_spec(t, at)
  local a = (at or 1) - 1
  local n = tonumber(t[a + 2])
  if n ~= ranks then
    ranks, waits = n, nil
  end
  local ceilings, fair, fracs = {}, {}, {}
  for i = 1, n do
    ceilings[i] = tonumber(t[a + 2 + i]) or math.huge  -- UNBOUND
    local letter = string.sub(t[a + 3 + n], i, i)
    fair[i] = letter ~= 'f' and letter
    fracs[i] = tonumber(t[a + 3 + n + i]) or 1
  end
  modes = fair
  local letters = t[a + 4 + 2 * n] or ''
  roles = {}
  for i = 1, n do roles[i] = string.sub(letters, i, i) end
  return tonumber(t[a + 1]), ceilings, fair, fracs
end

-- The words of a packed argument and its spec parsed (`words`, `parse_spec` from index `at`),
-- kept by the text they came from: a model's spec (and an acquire's packed argument, but for
-- a deadline) is the same from call to call, and a library of Redis Functions keeps them
-- between calls (about 4.5 usec a call; a script parses each time). What is kept is only
-- read. At most SPECS_MAX texts per `at`, all forgotten when that is reached.
local SPECS_MAX = 256
local specs, specs_n = {}, {}

local function spec_of(packed, at)
  at = at or 1
  local kept = specs[at]
  if not kept or specs_n[at] >= SPECS_MAX then
    kept = {}
    specs[at], specs_n[at] = kept, 0
  end
  local c = kept[packed]
  if not c then
    local t = words(packed)
    local claim, ceilings, fair, fracs = parse_spec(t, at)
    kept[packed], specs_n[at] = {t, claim, ceilings, fair, fracs, roles}, specs_n[at] + 1
    return t, claim, ceilings, fair, fracs
  end
  if #c[3] ~= ranks then ranks, waits = #c[3], nil end
  modes, roles = c[4], c[6]
  return c[1], c[2], c[3], c[4], c[5]
end

-- The endpoint keys' long entries (prelude `WIDE`), where missing: a Redis that lost them
-- (restarted empty, an older replica took the one in `free` for an endpoint).
local function wide()
  redis.call('ZADD', FREE, 'NX', '+inf', WIDE)
  redis.call('HSET', EP_LOAD, WIDE, '0')
  redis.call('HSET', EPS, WIDE, '0 0')
end
