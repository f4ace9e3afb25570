-- A waiter gives up at its queue timeout. ARGV: 1 waiter_id, 2 ttl_ms, 3 each tier's way of
-- sharing, one letter per tier, best first (prelude: `fair_modes`).
-- Returns, if it was still queued (and is removed), the grants likely to go before it if it
-- queued again (an integer, prelude: `turn_of`, for its Retry-After); else the endpoint it
-- was granted meanwhile (its wake-up may still be on the way): the slot is its own now,
-- claimed for the full lease TTL; '' for an id Redis knows nothing of.
redis.call('ZREM', QEXP, ARGV[1])  -- the first write, not `denyoom` (prelude: `expire`)
local place = redis.call('ZSCORE', QUEUE, ARGV[1])
if place then
  local rank = math.floor(tonumber(place) / RANK)
  local fair = fair_modes(ARGV[3])
  unqueue(ARGV[1], place)
  return turn_of(ARGV[1], rank, fair[rank + 1])
end
local ep, m = find_lease(ARGV[1])
if not ep then return '' end
keep_found(ARGV[1], ep, m, now_ms() + tonumber(ARGV[2]))
return ep
