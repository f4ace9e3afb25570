-- Append a usage record once: a request id already recorded is not recorded again (a flush
-- of the on-disk buffer may resend). KEYS[1] the stream `usage`, KEYS[2] {usage}:rid:<id>
-- (same Cluster slot as `usage`). ARGV: 1 seconds to remember the id, 2.. field/value pairs.
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
local entry = {}
for i = 2, #ARGV do entry[#entry + 1] = ARGV[i] end
redis.call('XADD', KEYS[1], '*', unpack(entry))
return 1
