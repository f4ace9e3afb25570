-- A waiter gives up at its queue timeout. ARGV: 1 waiter_id, 2 ttl_ms.
-- Returns '' if it was still queued (and is removed), else the endpoint it was granted
-- meanwhile (its wake-up may still be on the way): the slot is its own now, claimed for
-- the full lease TTL.
redis.call('ZREM', KEYS[7], ARGV[1])  -- the first write, not `denyoom` (prelude: `expire`)
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  unqueue(ARGV[1])
  return ''
end
local ep = redis.call('HGET', KEYS[3], ARGV[1])
if not ep then return '' end
redis.call('ZADD', KEYS[1], 'XX', now_ms() + tonumber(ARGV[2]), ARGV[1])
return ep
