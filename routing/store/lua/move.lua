-- Move a held lease off an endpoint that could not be reached, onto another with room,
-- without giving the slot up (a release would hand it to the queue head first).
-- ARGV: 1 lease_id, 2 ttl_ms, 3 the endpoint it is on, 4 the share of an endpoint's token
-- budget the lease's tier may fill (as acquire's), 5 k, 6.. k endpoints it may go to (the
-- least loaded of them with room, the first among equals: those the replica knows; with
-- k 0 the least loaded of all but `avoid`), 6 + k each tier's way of sharing (prelude:
-- `fair_modes`).
-- Returns the new endpoint, or '' when none has room (the lease stays where it was).
local now = now_ms()
local id, avoid, frac, k = ARGV[1], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
fair_modes(ARGV[6 + k])
expire(now)
-- Endpoints tried in this call: one that lacks only the tokens stays in `free` (smaller
-- requests fit there), so the next try must pass it, not take it again.
local tried, n_tried = {}, 0
-- The endpoint to move to: the least loaded of the k with room, else (k 0) the least
-- loaded other than `avoid`; neither one tried already; nil when none. O(k), or (k 0) a
-- range of at most the tries so far + 2: a move is rare (a worker unreachable).
local function choose()
  if k > 0 then
    local best, low = nil, nil
    for from = 6, 5 + k, 1000 do
      local upto = math.min(from + 999, 5 + k)
      local found = redis.call('ZMSCORE', FREE, unpack(ARGV, from, upto))
      for i = from, upto do
        local s = found[i - from + 1] and tonumber(found[i - from + 1])
        if s and ARGV[i] ~= avoid and not tried[ARGV[i]] and (not low or s < low) then
          best, low = ARGV[i], s
        end
      end
    end
    return best
  end
  for _, ep in ipairs(redis.call('ZRANGE', FREE, 0, n_tried + 1)) do
    if ep ~= avoid and not tried[ep] and ep ~= WIDE then return ep end
  end
  return nil
end
local was = id .. ' ' .. avoid
local expiry = redis.call('ZSCORE', LEASES, was)
-- `free` may have one wrong (a rolling update): `take_slot` drops it and the next is tried;
-- one that lacks only the tokens is passed. At most 8 tries, whatever the fleet's size.
for _ = 1, 8 do
  local ep = choose()
  if not ep then return '' end
  if not expiry then
    grant(id, ep, now + tonumber(ARGV[2]))  -- Redis lost it: written back where it goes now
    count(id, 1)
    return ep
  end
  if take_slot(ep, tokens_of(id), frac) then
    drop_lease(id, avoid)
    redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
    return ep
  end
  tried[ep], n_tried = true, n_tried + 1
end
return ''
