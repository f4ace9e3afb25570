-- Append a usage record once, and let the stream forget what is older than the retention.
-- KEYS[1] the stream `usage`, KEYS[2] {usage}:rid:<id>[:<attempt>] (same Cluster slot as
-- `usage`). ARGV: 1 retention (ms), 2 how long to remember the id (ms), 3.. field/value pairs.
-- Returns 1 when appended, 0 when the id was already recorded (a spool flush may resend).
--
-- The FIRST write must stay SET (a `denyoom` command). At maxmemory under noeviction Redis
-- refuses a script whose first write is denyoom before it changed anything: the record is
-- refused (the gateway keeps it in its spool and sends it later) instead of growing Redis
-- past its limit. Admission scripts keep working there, since Redis lets a script that has
-- already written finish. A write before this SET (even one that removes) would lift that.
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[2]) then
  return 0
end
local t = redis.call('TIME')
local floor = math.max(0, t[1] * 1000 + math.floor(t[2] / 1000) - ARGV[1])
-- `~`: whole stream nodes only, so an append never pays for trimming entry by entry. The
-- pairs go to XADD straight from ARGV (a copy cost 2-3 usec; packing them into one
-- argument and splitting it here cost more than Redis's own argument handling).
redis.call('XADD', KEYS[1], 'MINID', '~', string.format('%d', floor), '*', unpack(ARGV, 3))
return 1
