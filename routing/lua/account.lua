-- An account's own limit across replicas. KEYS[1] gw:acct:{account} ZSET lease_id -> expiry.
-- ARGV: 1 lease_id, 2 limit, 3 ttl_ms. Returns 1 when taken, 0 when the account is at its limit.
-- The first write (ZREMRANGEBYSCORE) frees memory, so this runs at maxmemory too.
-- Numbers go to Redis as text made here (redis.call's own '%.17g' costs more).
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], string.format('%.0f', now + ARGV[3]), ARGV[1])
-- The key goes with its last entry: accounts of replicas that died leave nothing behind.
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
