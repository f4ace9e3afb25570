-- Move a held lease off an endpoint that could not be reached, onto another with room,
-- without giving the slot up (a release would hand it to the queue head first).
-- ARGV: 1 lease_id, 2 ttl_ms, 3 the endpoint it is on, 4 k, 5.. k endpoints to prefer (the
-- first of them with room; with k 0 the least loaded of the others).
-- Returns the new endpoint, or '' when none has room (the lease stays where it was).
local now = now_ms()
expire(now)
local id, avoid, k = ARGV[1], ARGV[3], tonumber(ARGV[4])
-- The endpoint to move to: the first of the preferred with room, else the least loaded
-- other than `avoid`; nil when none.
local function choose()
  if k > 0 then
    local found = redis.call('ZMSCORE', FREE, unpack(ARGV, 5, 4 + k))
    for i = 1, k do
      if found[i] and ARGV[4 + i] ~= avoid then return ARGV[4 + i] end
    end
    return nil
  end
  local two = redis.call('ZRANGE', FREE, 0, 1)
  return two[1] ~= avoid and two[1] or two[2]
end
local was = id .. ' ' .. avoid
local expiry = redis.call('ZSCORE', LEASES, was)
-- `free` may have one wrong (a rolling update): `take_slot` drops it and the next is tried.
for _ = 1, 8 do
  local ep = choose()
  if not ep then return '' end
  if not expiry then
    grant(id, ep, now + tonumber(ARGV[2]))  -- Redis lost it: written back where it goes now
    count(id, 1)
    return ep
  end
  if take_slot(ep, tokens_of(id), 1) then
    drop_lease(id, avoid)
    redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
    return ep
  end
end
return ''
