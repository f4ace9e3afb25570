-- An account's own limit across replicas. KEYS[1] gw:acct:{account} ZSET lease_id -> expiry.
-- ARGV: 1 lease_id, 2 limit, 3 ttl_ms. Returns 1 when taken, 0 when the account is at its limit.
-- The first write (ZREMRANGEBYSCORE) frees memory, so this runs at maxmemory too.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
-- The key lives as long as its newest entry (every entry gets the same TTL): entries left
-- by a replica that died leave with it even if the account never sends again.
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
