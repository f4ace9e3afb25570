-- A replica says it is alive; returns whether Redis had lost it (1: its entry was gone, as
-- after a restart empty; routing/admission/accountkeeps.py), the live replicas' ids in
-- order (for the local outage shares, which must add up to at most the capacity), and the
-- mark its last heartbeat left (false: none).
-- KEYS[1] gw:replicas ZSET replica_id -> expiry; on one Redis KEYS[2] the replica's mark
-- (gw:beat:<replica_id>). ARGV: 1 replica_id, 2 ttl_ms, with KEYS[2] 3 this heartbeat's
-- mark and 4 how long it lasts (ms). Sent after a round's keeps of the accounts' entries,
-- the mark vouches for them: Redis applies (and a replica of it copies) writes in order,
-- so the next heartbeat finding this mark means every write before it is there still.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
local mark = false
if KEYS[2] then
  mark = redis.call('GET', KEYS[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
end
return {added, redis.call('ZRANGE', KEYS[1], 0, -1), mark}
