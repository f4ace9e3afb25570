-- Keep this replica's entries in an account's count alive (requests running and waiting),
-- writing back those Redis lost. KEYS[1] gw:acct:{account}. ARGV: 1 ttl_ms, 2.. lease ids.
-- Returns the ids that had to be written back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local restored = {}
for i = 2, #ARGV do
  if redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i]) == 1 then
    restored[#restored + 1] = ARGV[i]
  end
end
if #ARGV > 1 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) end
return restored
