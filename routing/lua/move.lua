-- Move a held lease off an endpoint that could not be reached, onto another with room,
-- without giving the slot up (a release would hand it to the queue head first).
-- ARGV: 1 lease_id, 2 ttl_ms, 3.. endpoints to choose from. Returns the new endpoint, or ''
-- when none has room (the lease stays where it was).
local now = now_ms()
expire(now)
local id = ARGV[1]
local ep = pick(ARGV, 3, 'least')
if not ep then return '' end
if not redis.call('ZSCORE', KEYS[1], id) then
  grant(id, ep, now + tonumber(ARGV[2]))  -- Redis lost it: written back where it goes now
  count(id, 1)
  return ep
end
local old = redis.call('HGET', KEYS[3], id)
if old then redis.call('HINCRBY', KEYS[4], old, -1) end
redis.call('HSET', KEYS[3], id, ep)
redis.call('HINCRBY', KEYS[4], ep, 1)
return ep
