-- Take a slot for a request, or queue it, or say why not. One round trip.
-- ARGV: 1 lease_id, 2 ttl_ms, 3 rank, 4 may_wait (0|1), 5 max_queue, 6 waiter_ttl_ms,
--       7 channel, 8 mode ('least'|'first'), 9 claim_ms, 10.. ceilings (n, then one per
--       tier, best first), then endpoints (n, then url, max, penalty triples), then known (0|1: this
--       replica has seen the model's state before) and rebuild_ms (see `lost`)
-- Returns {status, endpoint, inflight, ahead, seq, rebuild}: status 1 granted, 2 queued
-- (seq = its place in its tier), 0 busy, -1 full (ahead = waiters of the same or a better
-- tier); rebuild = ms left of the rebuild window when that is why it is busy, else 0.
local id, ttl, rank = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
-- The common case costs a few reads: room for the tier, nobody queued, the model's state
-- known and no rebuild. Then there is nothing to pump, and leases that expired meanwhile
-- (a replica died) only make the model look fuller until the sweep reclaims them.
if redis.call('ZCARD', KEYS[2]) == 0 then
  local inflight = redis.call('ZCARD', KEYS[1])
  local marks = redis.call('MGET', KEYS[9], KEYS[8])
  if marks[1] and not marks[2] and inflight < tonumber(ARGV[11 + rank]) then
    local ep = pick(11 + tonumber(ARGV[10]), ARGV[8])
    if ep then
      redis.call('ZREM', KEYS[2], id)  -- the first write, not `denyoom` (prelude: `expire`)
      grant(id, ep, now + ttl)
      return {1, ep, inflight + 1, 0, 0, 0}
    end
  end
end
local ceilings, after = ceilings_at(10)
local eps, at = endpoints(after)
expire(now)
lost(now, ARGV[at], ARGV[at + 1])
pump(now, tonumber(ARGV[9]), ceilings, eps, ARGV[7])
-- After the pump no waiter that could take a slot is left: a newcomer with room for its
-- tier jumps nobody who could have gone first.
local inflight = redis.call('ZCARD', KEYS[1])
if inflight < ceilings[rank + 1] and not rebuilding() then
  local ep = pick(eps, ARGV[8])
  if ep then
    grant(id, ep, now + ttl)
    return {1, ep, inflight + 1, 0, 0, 0}
  end
end
local ahead = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. score((rank + 1) * RANK))
-- While Redis is being rebuilt nobody queues either: the account counts this request was
-- checked against may not be written back yet, and a waiter would keep its entry.
if rebuilding() then return {0, '', inflight, ahead, 0, math.max(1, redis.call('PTTL', KEYS[8]))} end
if ARGV[4] ~= '1' then return {0, '', inflight, ahead, 0, 0} end
-- The bound counts the waiters a newcomer would wait behind, so flex waiters can never make
-- a priority request `queue_full` (the whole queue holds at most 3 x max_queue).
if ahead >= tonumber(ARGV[5]) then return {-1, '', inflight, ahead, 0, 0} end
local seq = redis.call('INCR', KEYS[5])
redis.call('ZADD', KEYS[2], score(rank * RANK + seq), id)
redis.call('ZADD', KEYS[7], now + tonumber(ARGV[6]), id)
return {2, '', inflight, ahead, seq, 0}
