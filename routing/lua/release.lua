-- Give a slot back and hand it on to the queue head. ARGV: 1 lease_id, 2 ttl_ms, 3 channel,
-- 4..6 ceilings, 7.. endpoints. Returns how many waiters were granted.
local now = now_ms()
if drop_lease(ARGV[1]) == 1 then redis.call('INCR', KEYS[6]) end
expire(now)
return pump(now, tonumber(ARGV[2]), ceilings_at(4), endpoints(7), ARGV[3])
