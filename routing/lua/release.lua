-- Give slots back (or take waiters out of the queue) and hand freed slots on.
-- ARGV: 1 channel, 2 the spec (prelude: `parse_spec`), 3 n, then n lease/waiter ids.
-- KEYS[10], on one Redis: the account whose entries for these ids go too.
-- Used for the end of a request, a waiter whose caller left, and any id whose state in
-- Redis is in doubt (idempotent: an id Redis does not hold changes nothing).
-- Returns how many waiters were granted.
local freed, others = {}, {}
for i = 4, 3 + tonumber(ARGV[3]) do
  -- A lease is never queued at the same time: a waiter leaves the queue when granted. One
  -- still queued leaves it below (the queue is not empty then).
  if drop_lease(ARGV[i]) == 1 then freed[#freed + 1] = ARGV[i] else others[#others + 1] = ARGV[i] end
  if KEYS[10] then redis.call('ZREM', KEYS[10], ARGV[i]) end
end
if #freed > 0 then redis.call('INCRBY', KEYS[6], score(#freed)) end
-- Nobody waits: nothing to hand on, and expired leases wait for the sweep.
if redis.call('ZCARD', KEYS[2]) == 0 then return 0 end
-- @rest
for _, id in ipairs(others) do unqueue(id) end
local now = now_ms()
local claim, ceilings, fair, spec, eps = parse_spec(ARGV[2])
-- The accounts that gave slots back have a better claim now (fair share).
for _, id in ipairs(freed) do
  count(id, -1)
  reweigh(id, #ceilings)
end
expire(now, nil, #ceilings)
return pump(now, claim, ceilings, fair, spec, eps, ARGV[1])
