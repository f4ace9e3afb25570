-- Append a usage record unless it was appended before: the way of every resend (the spool's,
-- the records a lost master took). A record's first send is a MULTI of the same writes
-- (routing/ledger.py `FirstSends`), which costs Redis half as much.
-- KEYS[1] the stream `usage`, KEYS[2] the set of identities of the record's second
-- ({usage}:rids:<second>), both in the Cluster slot of `usage`.
-- ARGV: 1 when the set may go (ms since the epoch), 2 the identity, 3.. field/value pairs.
-- Returns 1 when appended, 0 when the identity was already recorded. The stream is trimmed
-- to the retention by each replica's spool round (routing/ledger.py `trim_stream`), not here.
--
-- The FIRST write must stay SADD (a `denyoom` command). At maxmemory under noeviction Redis
-- refuses a script whose first write is denyoom before it changed anything: the record is
-- refused (the gateway keeps it in its spool and sends it later) instead of growing Redis
-- past its limit. Admission scripts keep working there, since Redis lets a script that has
-- already written finish. A write before this SADD (even one that removes) would lift that.
if redis.call('SADD', KEYS[2], ARGV[2]) == 0 then return 0 end
redis.call('PEXPIREAT', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return 1
