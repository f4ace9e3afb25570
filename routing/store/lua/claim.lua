-- Claim the grants of woken waiters for the full lease TTL (a grant lasts only the claim
-- time until then), writing back any that Redis lost (restart, failover); several in one
-- call: a replica gathers the claims of one moment (routing/admission/handback.py).
-- ARGV: 1 ttl_ms, 2 each tier's way of sharing (prelude: `fair_modes`), then lease_id/
-- endpoint pairs. Returns the ids that had to be written back.
-- Leases and waiters that expired meanwhile are left to the sweeps.
local expiry = now_ms() + tonumber(ARGV[1])
fair_modes(ARGV[2])
local restored = {}
for i = 3, #ARGV, 2 do
  local id, ep = ARGV[i], ARGV[i + 1]
  local m = id .. ' ' .. ep
  if redis.call('ZSCORE', LEASES, m) then
    -- The first write, not `denyoom` (prelude: `expire`).
    redis.call('HDEL', EP_OF, id)
    redis.call('ZADD', LEASES, 'XX', expiry, m)
  elseif hold(id, ep, expiry) == 1 then
    restored[#restored + 1] = id
  end
end
return restored
