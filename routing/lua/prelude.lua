-- Shared by the model scripts (prepended once when they are registered).
-- Every key of one model shares the hash tag {model}, so each script touches one slot.
-- KEYS[1] leases   ZSET lease_id -> expiry (ms, Redis TIME)
-- KEYS[2] queue    ZSET waiter_id -> rank * 1e15 + sequence (rank 0 priority, 1 default, 2 flex)
-- KEYS[3] ep_of    HASH lease_id -> endpoint url
-- KEYS[4] ep_load  HASH endpoint url -> leases held on it
-- KEYS[5] seq      STRING queue sequence
-- KEYS[6] freed    STRING slots freed so far (releases and expiries), for Retry-After
-- KEYS[7] qexp     ZSET waiter_id -> give-up time (ms): waiters of dead replicas leave by it
local RANK = 1e15

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function drop_lease(id)
  local ep = redis.call('HGET', KEYS[3], id)
  if ep then
    redis.call('HINCRBY', KEYS[4], ep, -1)
    redis.call('HDEL', KEYS[3], id)
  end
  return redis.call('ZREM', KEYS[1], id)
end

-- Reclaim leases whose holder stopped refreshing them, and waiters past their give-up time.
local function expire(now)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
  for _, id in ipairs(gone) do drop_lease(id) end
  if #gone > 0 then redis.call('INCRBY', KEYS[6], #gone) end
  local late = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)
  for _, id in ipairs(late) do
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', KEYS[7], id)
  end
end

-- Endpoints arrive as ARGV[from] = n, then n triples (url, max_concurrency, penalty); the
-- penalty (>= 0) is the worker's own load signal (queue, KV cache), 0 when not scraped.
local function endpoints(from)
  local n = tonumber(ARGV[from])
  local eps = {}
  for i = 1, n do
    local at = from + 3 * i - 2
    eps[i] = {ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])}
  end
  return eps
end

-- The endpoint to take: in 'first' mode the first with room (cache affinity order), else the
-- least loaded relative to its size, plus its penalty. nil when every endpoint is full.
local function pick(eps, mode)
  local best, best_score = nil, nil
  for _, e in ipairs(eps) do
    local load = tonumber(redis.call('HGET', KEYS[4], e[1]) or '0')
    if load < e[2] then
      if mode == 'first' then return e[1] end
      local score = load / e[2] + e[3]
      if best == nil or score < best_score then best, best_score = e[1], score end
    end
  end
  return best
end

local function grant(id, ep, expiry)
  redis.call('ZADD', KEYS[1], expiry, id)
  redis.call('HSET', KEYS[3], id, ep)
  redis.call('HINCRBY', KEYS[4], ep, 1)
end

-- Hand free slots to the queue head while its tier has room; wake each by message.
-- ceilings[rank + 1] = capacity x that tier's max_utilization.
local function pump(now, ttl, ceilings, eps, channel)
  local granted = 0
  while true do
    local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
    if #head == 0 then break end
    local rank = math.floor(tonumber(head[2]) / RANK)
    if redis.call('ZCARD', KEYS[1]) >= ceilings[rank + 1] then break end
    local ep = pick(eps, 'least')
    if not ep then break end
    redis.call('ZREM', KEYS[2], head[1])
    redis.call('ZREM', KEYS[7], head[1])
    grant(head[1], ep, now + ttl)
    redis.call('PUBLISH', channel, head[1] .. ' ' .. ep)
    granted = granted + 1
  end
  return granted
end

local function ceilings_at(from)
  return {tonumber(ARGV[from]), tonumber(ARGV[from + 1]), tonumber(ARGV[from + 2])}
end
