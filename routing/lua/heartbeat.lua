-- A replica says it is alive; returns how many replicas are (for the local outage share).
-- KEYS[1] gw:replicas ZSET replica_id -> expiry. ARGV: 1 replica_id, 2 ttl_ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return redis.call('ZCARD', KEYS[1])
