-- A replica says it is alive; returns whether Redis had lost it (1: its entry was gone, as
-- after a restart empty; routing/admission/accountkeeps.py) and the live replicas' ids in
-- order (for the local outage shares, which must add up to at most the capacity).
-- KEYS[1] gw:replicas ZSET replica_id -> expiry. ARGV: 1 replica_id, 2 ttl_ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local added = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return {added, redis.call('ZRANGE', KEYS[1], 0, -1)}
