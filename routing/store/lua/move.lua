-- Move a held lease off an endpoint that could not be reached, onto another with room,
-- without giving the slot up (a release would hand it to the queue head first).
-- ARGV: 1 lease_id, 2 ttl_ms, 3 the endpoint it is on, 4.. endpoints to choose from.
-- Returns the new endpoint, or '' when none has room (the lease stays where it was).
local now = now_ms()
expire(now)
local id = ARGV[1]
local ep = pick(ARGV, 4, 'least')
if not ep then return '' end
local was = id .. ' ' .. ARGV[3]
local expiry = redis.call('ZSCORE', LEASES, was)
if not expiry then
  grant(id, ep, now + tonumber(ARGV[2]))  -- Redis lost it: written back where it goes now
  count(id, 1)
  return ep
end
redis.call('ZREM', LEASES, was)
redis.call('HINCRBY', EP_LOAD, ARGV[3], '-1')
grant(id, ep, expiry)
return ep
