-- Each replica's sweep of one model (about every second):
--  1. reclaim expired leases and dead replicas' waiters;
--  2. keep this replica's leases (written back if Redis lost them);
--  3. keep its waiters alive in the queue, re-queue those Redis lost (original place), and
--     claim those granted meanwhile (a wake-up message may have been lost);
--  4. hand free slots on; 5. report the model's state.
-- ARGV: 1 ttl_ms, 2 waiter_ttl_ms, 3 channel, 4 the spec (prelude: `parse_spec`),
--       then n and n lease_id/endpoint pairs, then m and m waiter_id/score pairs, then
--       rebuild_ms: how long grants pause once this sweep had to write anything back, and
--       known (0|1: this replica has seen the model's state before).
-- Returns {{inflight, queued per tier (best first), freed so far}, written-back lease ids,
--          one entry per waiter: its granted endpoint or ''}.
-- Whether a queued waiter (at `place`) is in its account's queue too.
local function in_account_queue(id, place)
  local rank = math.floor(tonumber(place) / RANK)
  return redis.call('ZSCORE', account_queue(rank, (account_of(id))), id) ~= false
end

local now = now_ms()
-- Idle (nobody queued), a sweep skips the queue's work: late waiters, pump, counts per tier.
local waiting = redis.call('ZCARD', KEYS[2]) > 0
local claim, ceilings, fair, spec, eps = parse_spec(ARGV[4])
expire(now, waiting, #ceilings)
local marks = redis.call('MGET', KEYS[9], KEYS[6])  -- the state marker; slots freed so far
local ttl, wttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local at = 5
local tail = at + 2 * tonumber(ARGV[at]) + 1
tail = tail + 2 * tonumber(ARGV[tail]) + 1
lost(now, ARGV[tail + 1], ARGV[tail], marks[1] ~= false)
local restored = {}
local n = tonumber(ARGV[at])
for i = at + 1, at + 2 * n, 2 do
  if hold(ARGV[i], ARGV[i + 1], now + ttl) == 1 then restored[#restored + 1] = ARGV[i] end
end
at = at + 2 * n + 1
local granted, requeued = {}, 0
for i = at + 1, at + 2 * tonumber(ARGV[at]), 2 do
  local id = ARGV[i]
  local ep = redis.call('HGET', KEYS[3], id)
  if ep then
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, id)
    granted[#granted + 1] = ep
  else
    granted[#granted + 1] = ''
    local place = redis.call('ZSCORE', KEYS[2], id)
    if place and in_account_queue(id, place) then
      redis.call('ZADD', KEYS[7], 'XX', now + wttl, id)
    else
      -- Lost (or queued by a script that keeps no account queues): back at its place.
      if not place then requeued = requeued + 1 end
      place = place or ARGV[i + 1]
      local rank, seq = math.floor(tonumber(place) / RANK), tonumber(place) % RANK
      enqueue(id, rank, seq)
      redis.call('ZADD', KEYS[7], now + wttl, id)
      if tonumber(redis.call('GET', KEYS[5]) or '0') < seq then redis.call('SET', KEYS[5], score(seq)) end
    end
  end
end
if #restored + requeued > 0 and not rebuilding() then
  redis.call('SET', KEYS[8], '1', 'PX', ARGV[tail])
end
waiting = waiting or requeued > 0
if waiting then
  for _, id in ipairs(restored) do reweigh(id, #ceilings) end
  pump(now, claim, ceilings, fair, spec, eps, ARGV[3])
end
local function queued(rank)
  if not waiting then return 0 end
  return redis.call('ZCOUNT', KEYS[2], score(rank * RANK), '(' .. score((rank + 1) * RANK))
end
local state = {redis.call('ZCARD', KEYS[1])}
for rank = 0, #ceilings - 1 do state[#state + 1] = queued(rank) end
state[#state + 1] = tonumber(marks[2] or '0')
return {state, restored, granted}
