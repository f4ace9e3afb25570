-- Shared by the model scripts (prepended once when they are registered), in two parts: the
-- functions a script's common case needs, then (at the script's `-- @rest` line, or before
-- the script when it has none) the others. Lua makes each local function anew on every call
-- (about 50 ns each), so the common case stops before the rest are made.
-- Every key of one model shares the hash tag {model}, so each script touches one slot.
-- KEYS[1] leases   ZSET lease_id -> expiry (ms, Redis TIME)
-- KEYS[2] queue    ZSET waiter_id -> rank * 1e15 + sequence (rank 0 priority, 1 default, 2 flex)
-- KEYS[3] ep_of    HASH lease_id -> endpoint url
-- KEYS[4] ep_load  HASH endpoint url -> leases held on it
-- KEYS[5] seq      STRING queue sequence
-- KEYS[6] freed    STRING slots freed so far (releases and expiries), for Retry-After
-- KEYS[7] qexp     ZSET waiter_id -> liveness expiry (ms): its replica's sweep extends it, so
--                  the waiters of a dead replica leave the queue within the waiter TTL
-- KEYS[8] rebuild  STRING, present for a short while after Redis lost this model's state:
--                  no slot is granted until every replica has written back its own
-- KEYS[9] state    STRING, present while Redis holds this model's state: a replica that has
--                  seen it before and finds it gone knows Redis restarted empty or failed over
-- Fair share's keys (prelude's rest) are named after KEYS[2], with the same hash tag.
local RANK = 1e15

local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

-- A whole number as Redis takes it. Also for every number a hot path hands to Redis:
-- redis.call turns a Lua number into text with '%.17g', which costs more.
local function score(n)
  return string.format('%.0f', n)
end

-- Forget a lease. Its first write (ZREM) is not `denyoom`: see `expire`.
local function drop_lease(id)
  if redis.call('ZREM', KEYS[1], id) == 0 then return 0 end
  local ep = redis.call('HGET', KEYS[3], id)
  if ep then
    redis.call('HINCRBY', KEYS[4], ep, '-1')
    redis.call('HDEL', KEYS[3], id)
  end
  return 1
end

-- The endpoint to take from a list of them in `src` (ARGV, or a spec: `parse_spec`) at
-- index `eps`: n, then n triples (url, max_concurrency, penalty); the penalty (>= 0) is the
-- worker's own load signal (queue, KV cache), 0 when not scraped. In 'first' mode the first
-- with room (cache affinity order), else the least loaded relative to its size, plus its
-- penalty. nil when every endpoint is full. One HMGET reads their loads.
local function pick(src, eps, mode)
  local n = tonumber(src[eps])
  if n == 0 then return nil end
  local urls = {}
  for i = 1, n do urls[i] = src[eps + 3 * i - 2] end
  local loads = redis.call('HMGET', KEYS[4], unpack(urls))
  local best, best_score = nil, nil
  for i = 1, n do
    local size, load = tonumber(src[eps + 3 * i - 1]), tonumber(loads[i]) or 0
    if load < size then
      if mode == 'first' then return urls[i] end
      local s = load / size + tonumber(src[eps + 3 * i])
      if best == nil or s < best_score then best, best_score = urls[i], s end
    end
  end
  return best
end

local function grant(id, ep, expiry)
  redis.call('ZADD', KEYS[1], score(expiry), id)
  redis.call('HSET', KEYS[3], id, ep)
  redis.call('HINCRBY', KEYS[4], ep, '1')
end

-- An account's own limit across replicas: `key` is gw:acct:{account}, a ZSET lease_id ->
-- expiry. Takes an entry for `id` unless the account holds `limit` live ones (entries of
-- replicas that died are reclaimed only when it looks full); true when taken. The key goes
-- with its last entry: accounts of replicas that died leave nothing behind.
local function take_account(key, id, limit, ttl, now)
  if redis.call('ZCARD', key) >= limit then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', score(now))
    if redis.call('ZCARD', key) >= limit then return false end
  end
  redis.call('ZADD', key, score(now + ttl), id)
  redis.call('PEXPIRE', key, score(ttl))
  return true
end

-- @rest

-- Fair share. An id ends in "~weight~account" (routing/slots.py `make_lease_id`), so every
-- script knows a lease's or waiter's account and weight from its id alone (a dead replica's
-- lease too). Its keys are named after the queue's (the same hash tag, so the same node):
-- `held`   HASH account -> leases of the model it holds: counted only while someone waits
--          (the common case pays nothing), counted afresh from the leases when the queue
--          stops being empty (`enqueue`);
-- per tier, each waiting account's queue (ZSET waiter -> sequence), and the index of the
-- waiting accounts (ZSET "sequence of its oldest waiter, 16 digits" .. account -> held /
-- weight: the lowest score first, ties to the oldest waiter, which the member's order gives).
local RANKS = 3  -- tiers (tiers/policy.py), for callers without the spec
local BASE = string.sub(KEYS[2], 1, -6)
local HELD = BASE .. 'held'
local function account_queue(rank, acct) return BASE .. 'fq:' .. rank .. ':' .. acct end
local function account_index(rank) return BASE .. 'fi:' .. rank end
local function member(seq, acct) return string.format('%016d', seq) .. acct end

-- The account and weight an id carries ('' and 1 for an id without them).
local function account_of(id)
  local w, a = string.match(id, '~([^~]*)~([^~]*)$')
  return a or '', tonumber(w) or 1
end

-- A lease of `id`'s account was granted (1) or given back (-1): counted while someone waits.
local function count(id, delta)
  if redis.call('ZCARD', KEYS[2]) == 0 then return end
  local acct = account_of(id)
  if redis.call('HINCRBY', HELD, acct, delta) <= 0 then redis.call('HDEL', HELD, acct) end
end

-- Count every account's leases afresh (O(leases), once each time the queue stops being
-- empty; leases granted meanwhile were not counted).
local function recount()
  redis.call('DEL', HELD)
  local per = {}
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local acct = account_of(id)
    per[acct] = (per[acct] or 0) + 1
  end
  local flat = {}
  for acct, n in pairs(per) do
    flat[#flat + 1] = acct
    flat[#flat + 1] = n
  end
  if #flat > 0 then redis.call('HSET', HELD, unpack(flat)) end
end

-- Put `acct`'s entry in the index of `rank` right: after its oldest waiter or its leases
-- changed. `old`: its member before, when known to be in the index.
local function reindex(rank, acct, weight, old)
  local queue = account_queue(rank, acct)
  local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  local index = account_index(rank)
  if old then redis.call('ZREM', index, old) end
  if not head[1] then return end
  local ratio = (tonumber(redis.call('HGET', HELD, acct)) or 0) / weight
  redis.call('ZADD', index, string.format('%.17g', ratio), member(tonumber(head[2]), acct))
end

-- The account's leases changed: its entries in every tier's index follow (a no-op for an
-- account that waits nowhere). `ranks`: how many tiers.
local function reweigh(id, ranks)
  local acct, weight = account_of(id)
  for rank = 0, ranks - 1 do
    local head = redis.call('ZRANGE', account_queue(rank, acct), 0, 0, 'WITHSCORES')
    if head[1] then reindex(rank, acct, weight, member(tonumber(head[2]), acct)) end
  end
end

-- Queue `id` at `seq` in tier `rank`: in the model's queue, its account's and the index.
local function enqueue(id, rank, seq)
  if redis.call('ZCARD', KEYS[2]) == 0 then recount() end
  redis.call('ZADD', KEYS[2], score(rank * RANK + seq), id)
  local acct, weight = account_of(id)
  local queue = account_queue(rank, acct)
  local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  redis.call('ZADD', queue, score(seq), id)
  if head[1] == nil or seq < tonumber(head[2]) then
    reindex(rank, acct, weight, head[1] and member(tonumber(head[2]), acct))
  end
end

-- Take an id out of the queue (a no-op for an id never queued, but a write that is not
-- `denyoom`: see `expire`), its account's queue and, if it was the oldest, the index.
local function unqueue(id)
  redis.call('ZREM', KEYS[7], id)
  local place = redis.call('ZSCORE', KEYS[2], id)
  if not place then return end
  redis.call('ZREM', KEYS[2], id)
  if redis.call('ZCARD', KEYS[2]) == 0 then redis.call('DEL', HELD) end
  local rank, seq = math.floor(tonumber(place) / RANK), tonumber(place) % RANK
  local acct, weight = account_of(id)
  local queue = account_queue(rank, acct)
  redis.call('ZREM', queue, id)
  local old = member(seq, acct)
  if redis.call('ZSCORE', account_index(rank), old) then reindex(rank, acct, weight, old) end
end

-- How many grants likely go before a newcomer `id` of tier `rank`: the waiters of the same
-- or a better tier; in a `fair` tier the better tiers' waiters, its own account's waiters in
-- the tier, and for each other waiting account as many as its turn takes ((own + 1) /
-- weight each, as if the others weighed 1 and held as many slots), at most the whole tier.
local function turn_of(id, rank, fair)
  local ahead = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. score((rank + 1) * RANK))
  if not fair then return ahead end
  local better = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. score(rank * RANK))
  local acct, weight = account_of(id)
  local own = redis.call('ZCARD', account_queue(rank, acct))
  local others = redis.call('ZCARD', account_index(rank)) - math.min(own, 1)
  return better + math.min(ahead - better, own + math.ceil((own + 1) / weight) * others)
end

-- The oldest waiter of the account with the best claim in tier `rank` (fewest leases held
-- relative to its weight, then the oldest waiter), or nil. Entries left stale (a waiter
-- Redis no longer queues) are mended on the way.
local function fair_head(rank)
  local index = account_index(rank)
  for _ = 1, 64 do
    local best = redis.call('ZRANGE', index, 0, 0)[1]
    if not best then return nil end
    local acct = string.sub(best, 17)
    local head = redis.call('ZRANGE', account_queue(rank, acct), 0, 0)[1]
    if head and redis.call('ZSCORE', KEYS[2], head) then return head end
    if head then redis.call('ZREM', account_queue(rank, acct), head) end
    reindex(rank, acct, select(2, account_of(head or '')), best)
  end
  return nil
end

-- Reclaim leases whose holder stopped refreshing them, and waiters whose replica stopped
-- keeping them alive. Its first write (ZREMRANGEBYSCORE) frees memory and is not `denyoom`:
-- Redis lets a script that has begun writing finish even at maxmemory with noeviction, so
-- admission and release keep working when Redis is full (usage records, whose script
-- writes first with SET, are refused then and wait in the spool). So every model script
-- writes first either here or with another such write (ZREM: `drop_lease`, `unqueue`).
-- The sweep, claim and move run it on every call; acquire and release only when the model
-- may be full or has waiters (else leases that expired meanwhile wait for the sweep).
-- `waiting` false: the caller found the queue empty, so no late waiter needs to leave it.
-- `ranks`: the number of tiers, from the caller's spec (else those of tiers/policy.py).
local function expire(now, waiting, ranks)
  local late = {}
  local upto = score(now)
  if waiting ~= false then late = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', upto) end
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', upto)
  for _, id in ipairs(late) do unqueue(id) end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', upto)
  for _, id in ipairs(gone) do
    if drop_lease(id) == 1 then count(id, -1) end
  end
  if #gone > 0 and redis.call('ZCARD', KEYS[2]) > 0 then
    for _, id in ipairs(gone) do reweigh(id, ranks or RANKS) end
  end
  if #gone > 0 then redis.call('INCRBY', KEYS[6], score(#gone)) end
end

-- The waiter of the best tier that may take a slot now, or nil: in a `fair` tier the oldest
-- of the account with the best claim (`fair_head`), else the tier's oldest. A tier whose own
-- ceiling is reached does not hold up the tiers behind it (a priority ceiling set below
-- default's must not stall the default queue).
local function eligible_head(inflight, ceilings, fair)
  for rank = 0, #ceilings - 1 do
    if inflight < ceilings[rank + 1] then
      -- A tier's waiters queued by scripts without account queues go after the others.
      local head = fair[rank + 1] and {fair_head(rank)} or {}
      if not head[1] then
        head = redis.call('ZRANGEBYSCORE', KEYS[2], score(rank * RANK),
          '(' .. score((rank + 1) * RANK), 'LIMIT', 0, 1)
      end
      if head[1] then return head[1] end
    end
  end
  return nil
end

-- Redis lost this model's state (restart, failover) and replicas are writing back what they
-- hold: until all had a sweep to do so, free-looking slots may be held by requests running.
local function rebuilding()
  return redis.call('EXISTS', KEYS[8]) == 1
end

-- Whether Redis lost this model's state: the marker is gone. A replica that has seen it
-- before (`known`) then pauses grants for `rebuild_ms` (every replica's next sweep writes
-- back what it holds within it); one that never saw it (a first start) just sets it. The
-- queue's sequence restarts from Redis TIME, after any place a waiter held before.
-- `present`: whether the marker is there, when the caller read it already.
local function lost(now, known, rebuild_ms, present)
  if present == nil then present = redis.call('EXISTS', KEYS[9]) == 1 end
  if present then return false end
  redis.call('SET', KEYS[9], '1')
  if tonumber(redis.call('GET', KEYS[5]) or '0') < now then redis.call('SET', KEYS[5], score(now)) end
  if known == '1' and tonumber(rebuild_ms) > 0 then
    redis.call('SET', KEYS[8], '1', 'PX', rebuild_ms)
  end
  return true
end

-- Hand free slots to waiters, best tier first, while there is room; wake each by message.
-- A granted waiter's lease lasts only `claim` ms until its replica claims it (a grant to a
-- replica that died goes back quickly). ceilings[rank + 1] = capacity x max_utilization;
-- the endpoints are in `src` at `eps` (see `pick`); fair[rank + 1]: whether that tier shares
-- between accounts.
local function pump(now, claim, ceilings, fair, src, eps, channel)
  if redis.call('ZCARD', KEYS[2]) == 0 or rebuilding() then return 0 end
  local granted = 0
  while true do
    local id = eligible_head(redis.call('ZCARD', KEYS[1]), ceilings, fair)
    if not id then break end
    local ep = pick(src, eps, 'least')
    if not ep then break end
    unqueue(id)
    grant(id, ep, now + claim)
    count(id, 1)
    reweigh(id, #ceilings)
    redis.call('PUBLISH', channel, id .. ' ' .. ep)
    granted = granted + 1
  end
  return granted
end

-- A lease this replica holds: kept for `ttl` ms more, or written back if Redis lost it
-- (restart, failover). Returns 1 when it had to be written back.
local function hold(id, ep, expiry)
  unqueue(id)
  if redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], 'XX', expiry, id)
    return 0
  end
  grant(id, ep, expiry)
  count(id, 1)
  return 1
end

-- Space-separated words (numbers, URLs: an endpoint URL never holds a space).
local function words(s)
  local t = {}
  for word in string.gmatch(s, '%S+') do t[#t + 1] = word end
  return t
end

-- What pumping needs, in one argument read only when someone waits (an argument costs a
-- script about 75 ns whether read or not): "claim_ms n ceiling.. fair n url max penalty..",
-- the tiers' ceilings best first, then one letter per tier, best first ('a' shares between
-- accounts, 'f' first come first served). Returns claim_ms, the ceilings, whether each tier
-- is fair, and the words and index of the endpoints for `pick`.
local function parse_spec(s)
  local t = words(s)
  local n = tonumber(t[2])
  local ceilings, fair = {}, {}
  for i = 1, n do
    ceilings[i] = tonumber(t[2 + i])
    fair[i] = string.sub(t[3 + n], i, i) == 'a'
  end
  return tonumber(t[1]), ceilings, fair, t, 4 + n
end
