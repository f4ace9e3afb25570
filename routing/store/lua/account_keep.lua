-- Keep this replica's entries in accounts' counts alive (requests running and waiting),
-- writing back those Redis lost. KEYS: the accounts' keys, gw:acct:{account} (on a Cluster
-- one per call: each its own hash tag; on one Redis as many as the keeper batches: one
-- call for them all costs about a third of one call each). ARGV: 1 ttl_ms, 2 this
-- replica's id and 3 the number its ids have reached when the keep is to take out what
-- it no longer holds ('' and '' else), then per key the number of its lease ids and those
-- ids, and when taking out, the number of ids it may hold an entry of unknown to it yet
-- (walks under way) and those.
-- Taking out: after Redis lost writes (a failover to a replica that lagged) an account's
-- key holds again entries the lost window had taken back; each replica's keep of all it
-- holds there (routing/admission/accountkeeps.py) takes out every other entry of its ids
-- numbered up to what it says ("<replica>-<n>~...": issued before the keep left), so a
-- limited account is not refused for requests no one runs until the entries expire.
-- Returns per key the ids that had to be written back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local expiry = now + ttl
local prefix, upto = ARGV[2] .. '-', tonumber(ARGV[3])
local out, at = {}, 4
for k = 1, #KEYS do
  local key, n = KEYS[k], tonumber(ARGV[at])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local restored, mine = {}, {}
  for i = at + 1, at + n do
    mine[ARGV[i]] = true
    if redis.call('ZADD', key, expiry, ARGV[i]) == 1 then restored[#restored + 1] = ARGV[i] end
  end
  at = at + n + 1
  if upto then
    for i = at + 1, at + tonumber(ARGV[at]) do mine[ARGV[i]] = true end
    at = at + tonumber(ARGV[at]) + 1
    for _, id in ipairs(redis.call('ZRANGE', key, '0', '-1')) do
      if not mine[id] and string.sub(id, 1, #prefix) == prefix then
        local number = tonumber(string.match(id, '^(%d+)~', #prefix + 1))
        if number and number <= upto then redis.call('ZREM', key, id) end
      end
    end
  end
  if n > 0 then redis.call('PEXPIRE', key, ttl) end
  out[k] = restored
end
return out
