-- Keep this replica's leases alive, writing back any that Redis lost (restart, failover),
-- and claim the grants of woken waiters. ARGV: 1 ttl_ms, then lease_id/endpoint pairs.
-- Returns the ids that had to be written back.
local now = now_ms()
expire(now)
local expiry = now + tonumber(ARGV[1])
local restored = {}
for i = 2, #ARGV, 2 do
  if hold(ARGV[i], ARGV[i + 1], expiry) == 1 then restored[#restored + 1] = ARGV[i] end
end
return restored
