-- Rate limits of one account and its keys (requests and tokens per minute), exact across
-- replicas: GCRA. Each limit is a bucket holding a whole minute's worth, refilled
-- continuously; its state is one number, the theoretical arrival time (TAT: when the bucket
-- is full again), in microseconds of Redis TIME since 2026-01-01 (a double: exact to a few
-- nanoseconds for decades; routing/admission/ratelimit.py). A request conforms when every
-- bucket, charged, is still at most a minute ahead of now; then all of them are charged,
-- else none.
-- KEYS[1] gw:rl:{account}, a HASH of the account's buckets: `r` and `t` the account's,
-- `r:<key id>` and `t:<key id>` its keys'. ARGV: 1 '1' to take the request's charge, '0' to
-- read only; 2 the request's tokens; 3.. pairs: a bucket's field and its limit per minute.
-- A field's first letter is its kind: `r` counts requests (1 each), `t` tokens (ARGV[2]).
-- Returns {status, wait_ms, then for requests and for tokens: limit, remaining, reset_ms}:
-- status 1 taken (or read), 0 refused by a requests bucket, -1 by a tokens bucket, -2 the
-- tokens are more than a bucket holds (the request can never conform); wait_ms: until it
-- would conform; per kind the bucket with the fewest remaining after this call (0 0 0 for a
-- kind without a limit), reset_ms: until that bucket is full again.
local WINDOW, EPOCH, TTL = 60000000, 1767225600, 120000
local t = redis.call('TIME')
local now = (tonumber(t[1]) - EPOCH) * 1000000 + tonumber(t[2])
local take, tokens = ARGV[1] == '1', tonumber(ARGV[2])
local fields, limits = {}, {}
for i = 3, #ARGV, 2 do
  fields[#fields + 1] = ARGV[i]
  limits[#limits + 1] = tonumber(ARGV[i + 1])
end
local stored = redis.call('HMGET', KEYS[1], unpack(fields))
local status, wait = 1, 0
local tat, after = {}, {}
for i = 1, #fields do
  local limit, requests = limits[i], string.byte(fields[i]) == 114  -- 114: 'r'
  local cost = requests and 1 or tokens
  tat[i] = math.max(tonumber(stored[i]) or now, now)
  after[i] = tat[i] + cost * WINDOW / limit
  if take and cost > limit then
    status, wait = -2, WINDOW
  elseif take and status ~= -2 and after[i] - now - WINDOW > wait then
    wait = after[i] - now - WINDOW
    status = requests and 0 or -1
  end
end
local taken = take and status == 1
if taken then
  local args = {}
  for i = 1, #fields do
    args[#args + 1] = fields[i]
    args[#args + 1] = after[i]  -- a number: Redis writes it exactly (`..` would round it)
  end
  -- The first write is not `denyoom`, so a take runs at maxmemory too (the hash is small
  -- and bounded by the account's keys); a hash it had to make gets its expiry after.
  local existed = redis.call('PEXPIRE', KEYS[1], TTL)
  redis.call('HSET', KEYS[1], unpack(args))
  if existed == 0 then redis.call('PEXPIRE', KEYS[1], TTL) end
end
local out = {status, math.ceil(wait / 1000), 0, 0, 0, 0, 0, 0}
for i = 1, #fields do
  local level = taken and after[i] or tat[i]
  local limit = limits[i]
  local left = math.floor((now + WINDOW - level) * limit / WINDOW + 1e-6)
  left = math.max(0, math.min(limit, left))
  local at = string.byte(fields[i]) == 114 and 3 or 6
  if out[at] == 0 or left < out[at + 1] then
    out[at], out[at + 1], out[at + 2] = limit, left, math.ceil((level - now) / 1000)
  end
end
return out
