-- A waiter gives up (timeout or caller gone). ARGV: 1 waiter_id.
-- Returns the endpoint if it had already been granted a slot (a message may still be on
-- its way: the slot is its own now), or '' if it was still queued (and is removed).
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[7], ARGV[1])
  return ''
end
redis.call('ZREM', KEYS[7], ARGV[1])
return redis.call('HGET', KEYS[3], ARGV[1]) or ''
