-- Take a slot for a request, or queue it, or say why not. One round trip.
-- ARGV: 1 lease_id, 2 ttl_ms, 3 rank, 4 may_wait (0|1), 5 max_queue, 6 wait_ms,
--       7 channel, 8 mode ('least'|'first'), 9..11 ceilings (priority, default, flex),
--       12.. endpoints (n, then url, max, penalty triples)
-- Returns {status, endpoint, inflight, ahead}: status 1 granted, 2 queued, 0 busy, -1 full.
local id, ttl, rank = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local ceilings = ceilings_at(9)
local eps = endpoints(12)
local now = now_ms()
expire(now)
pump(now, ttl, ceilings, eps, ARGV[7])
local inflight = redis.call('ZCARD', KEYS[1])
-- Waiters of the same or a better tier come first: a newcomer never jumps them.
local ahead = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. string.format('%.0f', (rank + 1) * RANK))
if ahead == 0 and inflight < ceilings[rank + 1] then
  local ep = pick(eps, ARGV[8])
  if ep then
    grant(id, ep, now + ttl)
    return {1, ep, inflight + 1, 0}
  end
end
if ARGV[4] ~= '1' then return {0, '', inflight, ahead} end
local depth = redis.call('ZCARD', KEYS[2])
if depth >= tonumber(ARGV[5]) then return {-1, '', inflight, depth} end
local seq = redis.call('INCR', KEYS[5])
redis.call('ZADD', KEYS[2], rank * RANK + seq, id)
redis.call('ZADD', KEYS[7], now + tonumber(ARGV[6]), id)
return {2, '', inflight, ahead}
