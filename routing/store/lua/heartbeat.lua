-- A replica says it is alive; returns the live replicas' ids in order (for the local
-- outage shares, which must add up to at most the capacity).
-- KEYS[1] gw:replicas ZSET replica_id -> expiry. ARGV: 1 replica_id, 2 ttl_ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return redis.call('ZRANGE', KEYS[1], 0, -1)
