-- The slow sweep of each replica: reclaim expired leases, hand freed slots to waiters, and
-- report the model's state. ARGV: 1 ttl_ms, 2 channel, 3..5 ceilings, 6.. endpoints.
-- Returns {inflight, queued priority, queued default, queued flex, freed so far}.
local now = now_ms()
expire(now)
pump(now, tonumber(ARGV[1]), ceilings_at(3), endpoints(6), ARGV[2])
local function queued(rank)
  return redis.call('ZCOUNT', KEYS[2], string.format('%.0f', rank * RANK),
    '(' .. string.format('%.0f', (rank + 1) * RANK))
end
return {redis.call('ZCARD', KEYS[1]), queued(0), queued(1), queued(2),
  tonumber(redis.call('GET', KEYS[6]) or '0')}
