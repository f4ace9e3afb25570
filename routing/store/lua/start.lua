-- A request of a tier that may be preempted is about to send its first byte to its caller:
-- from now on it is never preempted (prelude: `pre`, `preempt`).
-- KEYS: 1 the model's leases (prelude). ARGV: 1 lease_id, 2 its endpoint.
-- Returns 1: go on; 0: it was preempted first (send nothing: cut it short, give it back).
-- The first write, ZREM, is not `denyoom` (prelude: `expire`).
if redis.call('ZREM', PRE, ARGV[1] .. ' ' .. ARGV[2]) == 1 then return 1 end
if redis.call('ZSCORE', DOOMED, ARGV[1]) then return 0 end
-- Not marked either way (Redis lost its state, a grant written back): nobody chose it.
return 1
