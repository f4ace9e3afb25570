-- Give slots back (or take waiters out of the queue) and hand freed slots on.
-- ARGV: 1 claim_ms, 2 channel, 3.. ceilings (n, then one per tier), then endpoints, then n
-- and n lease/waiter ids.
-- Used for the end of a request, a waiter whose caller left, and any id whose state in
-- Redis is in doubt (idempotent: an id Redis does not hold changes nothing).
-- Returns how many waiters were granted.
local eps = 4 + tonumber(ARGV[3])
local _, at = endpoints(eps)
local freed = 0
for i = at + 1, at + tonumber(ARGV[at]) do
  -- A lease is never queued at the same time: a waiter leaves the queue when granted.
  if drop_lease(ARGV[i]) == 1 then freed = freed + 1 else unqueue(ARGV[i]) end
end
if freed > 0 then redis.call('INCRBY', KEYS[6], score(freed)) end
-- Nobody waits: nothing to hand on, and expired leases wait for the sweep.
if redis.call('ZCARD', KEYS[2]) == 0 then return 0 end
local now = now_ms()
expire(now)
return pump(now, tonumber(ARGV[1]), ceilings_at(3), eps, ARGV[2])
