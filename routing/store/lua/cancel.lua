-- A waiter gives up at its queue timeout. ARGV: 1 waiter_id, 2 ttl_ms, 3 fair (1|0: its tier
-- shares between accounts).
-- Returns, if it was still queued (and is removed), the grants likely to go before it if it
-- queued again (an integer, prelude: `turn_of`, for its Retry-After); else the endpoint it
-- was granted meanwhile (its wake-up may still be on the way): the slot is its own now,
-- claimed for the full lease TTL; '' for an id Redis knows nothing of.
redis.call('ZREM', QEXP, ARGV[1])  -- the first write, not `denyoom` (prelude: `expire`)
local place = redis.call('ZSCORE', QUEUE, ARGV[1])
if place then
  unqueue(ARGV[1], place)
  return turn_of(ARGV[1], math.floor(tonumber(place) / RANK), ARGV[3] == '1')
end
local ep, m = find_lease(ARGV[1])
if not ep then return '' end
keep_found(ARGV[1], ep, m, now_ms() + tonumber(ARGV[2]))
return ep
