-- Write a model's endpoint index (prelude: `eps`, `free`, and `~v` in `ep_load`) from a
-- replica's view of the endpoints in rotation: at its start, on reload, when health changes,
-- when an acquire found no index (a first start, Redis lost it) and when its sweep found
-- another version than its own (another replica wrote another view, or a failover lost a
-- write: the last writer's view stands, the next sweep of each replica sets its own again).
-- KEYS: 1 the model's leases (prelude).
-- ARGV: 1 version, 2 base: '' when the endpoints given are all those in rotation (any other
--       leaves the index), else the version the change applies to (the writer's last
--       write), 3 known, 4 rebuild_ms (prelude: `lost`), 5 n, then n fives url,
--       max_concurrency, penalty, token budget (0: none) and whole budget (what it holds
--       unadapted: prelude `parse_ep`), then m and m urls that leave.
-- O(n + m), and O(endpoints in the index) when whole: run on a change, never per request.
-- Returns 1; 0 when a change finds another version than its base (Redis lost the index,
-- or another replica wrote its own view since): nothing is written, the replica writes
-- its view whole instead. A change applied over another index would label a part as the
-- whole, and nothing would ever write it whole again.
if ARGV[2] ~= '' and redis.call('HGET', EP_LOAD, '~v') ~= ARGV[2] then return 0 end
local now = now_ms()
lost(now, ARGV[3], ARGV[4])
local n = tonumber(ARGV[5])
local given, spec = {}, {}
for i = 6, 5 + 5 * n, 5 do
  given[ARGV[i]] = true
  spec[#spec + 1] = ARGV[i]
  -- "size penalty", and " budget whole" where the endpoint holds one (prelude: `eps`).
  local budget = ARGV[i + 3] ~= '0' and (' ' .. ARGV[i + 3] .. ' ' .. ARGV[i + 4]) or ''
  spec[#spec + 1] = ARGV[i + 1] .. ' ' .. ARGV[i + 2] .. budget
end
local leave = {}
if ARGV[2] == '' then
  for _, url in ipairs(redis.call('HKEYS', EPS)) do
    if not given[url] and url ~= WIDE then leave[#leave + 1] = url end
  end
else
  local at = 6 + 5 * n
  for i = at + 1, at + tonumber(ARGV[at]) do leave[#leave + 1] = ARGV[i] end
end
-- In parts: Lua's unpack takes a few thousand values at most.
for from = 1, #leave, 1000 do
  local upto = math.min(from + 999, #leave)
  redis.call('HDEL', EPS, unpack(leave, from, upto))
  redis.call('ZREM', FREE, unpack(leave, from, upto))
end
for from = 1, #spec, 2000 do
  redis.call('HSET', EPS, unpack(spec, from, math.min(from + 1999, #spec)))
end
for i = 6, 5 + 5 * n, 5 do
  rescore(ARGV[i], tonumber(redis.call('HGET', EP_LOAD, ARGV[i])) or 0)
end
redis.call('HSET', EP_LOAD, '~v', ARGV[1])
wide()
return 1
