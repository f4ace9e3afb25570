-- An account's own limit across replicas, where its key is on another node than the model's
-- (a Redis Cluster; on one Redis, acquire.lua takes the entry itself).
-- KEYS[1] gw:acct:{account}. ARGV: 1 lease_id, 2 limit, 3 ttl_ms.
-- Returns 1 when taken, 0 when the account is at its limit.
-- @needs now_ms take_account
local now = now_ms()
-- The first write frees memory (not `denyoom`), so this runs at maxmemory too.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
-- (Returns inside a block: the prelude's rest follows, never run.)
if take_account(KEYS[1], ARGV[1], tonumber(ARGV[2]), now, now + ARGV[3], ARGV[3]) then
  return 1
else
  return 0
end
-- @rest
