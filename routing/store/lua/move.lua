-- Move a held lease off an endpoint that could not be reached, onto another with room,
-- without giving the slot up (a release would hand it to the queue head first).
-- ARGV: 1 lease_id, 2 ttl_ms, 3 the endpoint it is on, 4 k, 5.. k endpoints it may go to
-- (the least loaded of them with room, the first among equals: those the replica knows;
-- with k 0 the least loaded of all but `avoid`), 5 + k each tier's way of sharing (prelude:
-- `fair_modes`).
-- Returns the new endpoint, or '' when none has room (the lease stays where it was).
local now = now_ms()
local id, avoid, k = ARGV[1], ARGV[3], tonumber(ARGV[4])
fair_modes(ARGV[5 + k])
expire(now)
-- The endpoint to move to: the least loaded of the k with room, else (k 0) the least
-- loaded other than `avoid`; nil when none. O(k): a move is rare (a worker unreachable).
local function choose()
  if k > 0 then
    local best, low = nil, nil
    for from = 5, 4 + k, 1000 do
      local upto = math.min(from + 999, 4 + k)
      local found = redis.call('ZMSCORE', FREE, unpack(ARGV, from, upto))
      for i = from, upto do
        local s = found[i - from + 1] and tonumber(found[i - from + 1])
        if s and ARGV[i] ~= avoid and (not low or s < low) then best, low = ARGV[i], s end
      end
    end
    return best
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
