-- Settle an account's rate buckets (ratelimit.lua) after the fact: a walk that admitted
-- nothing gives its charge back, and a request that ended trues its token charge up to what
-- it used. No check: what was used is used.
-- KEYS[1] gw:rl:{account}. ARGV: 1 requests to add, 2 tokens to add (negative: given back),
-- 3.. pairs: a bucket's field and its limit per minute (as ratelimit.lua).
-- A bucket given back to is never fuller than full; one added to is never more than a whole
-- minute in debt (its TAT at most a minute ahead: so a Retry-After is never more than one).
-- Returns 1 when it wrote, else 0.
local WINDOW, EPOCH, TTL = 60000000, 1767225600, 120000
local t = redis.call('TIME')
local now = (tonumber(t[1]) - EPOCH) * 1000000 + tonumber(t[2])
local add = {r = tonumber(ARGV[1]), t = tonumber(ARGV[2])}
-- The first write is not `denyoom` (it runs at maxmemory too); a hash that is gone holds
-- only full buckets, to which nothing can be given back.
local existed = redis.call('PEXPIRE', KEYS[1], TTL) == 1
local fields = {}
for i = 3, #ARGV, 2 do fields[#fields + 1] = ARGV[i] end
local stored = existed and redis.call('HMGET', KEYS[1], unpack(fields)) or {}
local args = {}
for i = 1, #fields do
  local delta = add[string.sub(fields[i], 1, 1)] or 0
  local per = WINDOW / tonumber(ARGV[2 + 2 * i])
  local tat = tonumber(stored[i])
  if delta > 0 then
    tat = math.min(math.max(tat or now, now) + delta * per, now + WINDOW)
  elseif delta < 0 and tat and tat > now then
    tat = tat + delta * per  -- below now: full
  else
    tat = nil
  end
  if tat then
    args[#args + 1] = fields[i]
    args[#args + 1] = tat
  end
end
if #args == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(args))
if not existed then redis.call('PEXPIRE', KEYS[1], TTL) end
return 1
