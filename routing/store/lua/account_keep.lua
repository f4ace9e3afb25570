-- Keep this replica's entries in accounts' counts alive (requests running and waiting),
-- writing back those Redis lost. KEYS: the accounts' keys, gw:acct:{account} (on a Cluster
-- one per call: each its own hash tag; on one Redis as many as the keeper batches: one
-- call for them all costs about a third of one call each). ARGV: 1 ttl_ms, then per key
-- the number of its lease ids and those ids.
-- Returns per key the ids that had to be written back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local expiry = now + ttl
local out, at = {}, 2
for k = 1, #KEYS do
  local key, n = KEYS[k], tonumber(ARGV[at])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local restored = {}
  for i = at + 1, at + n do
    if redis.call('ZADD', key, expiry, ARGV[i]) == 1 then restored[#restored + 1] = ARGV[i] end
  end
  if n > 0 then redis.call('PEXPIRE', key, ttl) end
  out[k] = restored
  at = at + n + 1
end
return out
