-- Append a usage record unless it was appended before: the way of every resend (the spool's,
-- the records a lost master took). A record's first send is a MULTI of the same two writes
-- (routing/ledger.py `first_record_call`), which costs Redis half as much.
-- KEYS[1] the stream `usage`, KEYS[2] {usage}:rid:<id>[:<attempt>] (same Cluster slot as
-- `usage`). ARGV: 1 how long to remember the id (ms), 2.. field/value pairs.
-- Returns 1 when appended, 0 when the id was already recorded. The stream is trimmed to the
-- retention by each replica's spool round (routing/ledger.py `trim_stream`), not here.
--
-- The FIRST write must stay SET (a `denyoom` command). At maxmemory under noeviction Redis
-- refuses a script whose first write is denyoom before it changed anything: the record is
-- refused (the gateway keeps it in its spool and sends it later) instead of growing Redis
-- past its limit. Admission scripts keep working there, since Redis lets a script that has
-- already written finish. A write before this SET (even one that removes) would lift that.
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then
  return 0
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
