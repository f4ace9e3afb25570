-- Keep leases alive: push the expiry of each listed lease that still exists.
-- KEYS[1] a lease ZSET (a model's or an account's). ARGV: 1 ttl_ms, 2.. lease ids.
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local kept = 0
for i = 2, #ARGV do
  kept = kept + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i])
end
return kept
