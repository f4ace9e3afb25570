-- Fair share between the accounts waiting in a tier: what each holds (`held`), each
-- account's queue and the index of the waiting accounts.
-- Whether fair share's counts are kept (`held`), in the low bit of `~f` (its other bits count
-- frees): while someone waits, and for a while after the queue was last found empty (see
-- `settle_counting`). Set, the common cases take the long way, which counts. Set to `on`,
-- the field made if missing (without it the common cases take the long way). Returns `~f`.
local function mark_waiting(on)
  local marks = tonumber(redis.call('HGET', EP_LOAD, '~f') or '-1')
  if marks < 0 then
    marks = on and 1 or 0
    redis.call('HSET', EP_LOAD, '~f', marks)
  elseif (marks % 2 == 1) ~= on then
    marks = redis.call('HINCRBY', EP_LOAD, '~f', on and 1 or -1)
  end
  counted = on
  return marks
end

-- Whether fair share's counts are kept now: read once per call (`counted`, which a caller
-- that read `~f` sets itself).
local function counting()
  if counted == nil then
    counted = tonumber(redis.call('HGET', EP_LOAD, '~f') or '0') % 2 == 1
  end
  return counted
end

-- Count every account's leases afresh (O(leases), once each time counting starts again:
-- leases granted while it was off were not counted).
local function recount()
  redis.call('DEL', HELD)
  local per = {}
  for _, m in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
    local id = string.match(m, '^[^ ]+')
    local acct, t = account_of(id), tokens_of(id)
    per[acct] = (per[acct] or 0) + 1
    if t > 0 then per['t:' .. acct] = (per['t:' .. acct] or 0) + t end
  end
  local flat = {}
  for acct, n in pairs(per) do
    flat[#flat + 1] = acct
    flat[#flat + 1] = n
  end
  if #flat > 0 then redis.call('HSET', HELD, unpack(flat)) end
end

-- One waiter more (`delta` 1) or fewer (-1) in tier `rank`: its count follows. A queue left
-- empty keeps fair share's counts (the sweeps forget them once it stays so: `settle_counting`).
local function queued_delta(rank, delta)
  local w = waiting_counts()
  local field = '~w' .. rank_text(rank)
  local n = redis.call('HINCRBY', EP_LOAD, field, delta > 0 and '1' or '-1')
  if n < 0 then  -- counted before by a replica that did not count (a rolling update)
    redis.call('HSET', EP_LOAD, field, '0')
    n = 0
  end
  w[rank + 1] = n
end

-- What `acct` holds by tier `rank`'s measure (`modes`): its leases, or their tokens.
local function held_field(acct, rank)
  if modes and modes[rank + 1] == 't' then return 't:' .. acct end
  return acct
end

local function held_of(acct, rank)
  return tonumber(redis.call('HGET', HELD, held_field(acct, rank))) or 0
end

-- Put `acct`'s entry in the index of `rank` right: after its oldest waiter or its leases
-- changed. `old`: its member before, when known to be in the index.
local function reindex(rank, acct, weight, old)
  local queue = account_queue(rank, acct)
  local head = redis.call('ZRANGE', queue, '0', '0', 'WITHSCORES')
  local index = account_index(rank)
  if old then redis.call('ZREM', index, old) end
  if not head[1] then return end
  redis.call('ZADD', index, held_of(acct, rank) / weight, member(head[2], acct))
end

-- A lease of `id`'s account was granted (1) or given back (-1): counted while the counts are
-- kept (`counting`; its tokens too, where it reserves some), and the account's entries in the
-- indexes of the tiers it waits in follow (`skip`: a tier whose entry the caller sets
-- itself). Only tiers with waiters are looked at: one call per tier the account waits in.
-- Returns the account, its weight, and a function of a rank: what it holds now by that
-- tier's measure (nil while the counts are not kept).
local function count(id, delta, skip)
  if not counting() then return nil end
  local acct, weight = account_of(id)
  local held = {[acct] = redis.call('HINCRBY', HELD, acct, delta > 0 and '1' or '-1')}
  local t = tokens_of(id)
  if t > 0 then
    local field = 't:' .. acct
    held[field] = redis.call('HINCRBY', HELD, field, delta > 0 and t or -t)
  end
  for field, n in pairs(held) do
    if n <= 0 then
      redis.call('HDEL', HELD, field)
      held[field] = 0
    end
  end
  local function now(rank)
    local field = held_field(acct, rank)
    return held[field] or held_of(acct, rank)
  end
  for rank, n in ipairs(waiting_counts()) do
    rank = rank - 1
    if rank ~= skip and n > 0 then
      local head = redis.call('ZRANGE', account_queue(rank, acct), '0', '0', 'WITHSCORES')
      if head[1] then
        redis.call('ZADD', account_index(rank), now(rank) / weight, member(head[2], acct))
      end
    end
  end
  return acct, weight, now
end

-- Queue `id` at `seq` (its digits, as text) in tier `rank`: in the model's queue, its
-- account's and the index. `own`: how many its account had queued in the tier before, when
-- the caller read it (a newcomer, whose sequence is the newest: it heads its account's
-- queue only when that was empty); nil for a waiter queued again at its old place (the
-- sweep), which may head it.
local function enqueue(id, rank, seq, own)
  if not counting() then
    recount()
    mark_waiting(true)
  end
  if redis.call('ZADD', QUEUE, place_of(rank, seq), id) == 1 then queued_delta(rank, 1) end
  local acct, weight = account_of(id)
  local queue = account_queue(rank, acct)
  if own and own > 0 then
    redis.call('ZADD', queue, seq, id)
    return
  end
  local head = own and {} or redis.call('ZRANGE', queue, '0', '0', 'WITHSCORES')
  redis.call('ZADD', queue, seq, id)
  if head[1] == nil or tonumber(seq) < tonumber(head[2]) then
    local index = account_index(rank)
    if head[1] then redis.call('ZREM', index, member(head[2], acct)) end
    redis.call('ZADD', index, held_of(acct, rank) / weight, member(seq, acct))
  end
end

-- Take an id out of the queue (a no-op for an id never queued, but a write that is not
-- `denyoom`: see `expire`), its account's queue and, if it was the oldest, the index.
-- `place`: its score in the queue, when the caller read it.
local function unqueue(id, place)
  redis.call('ZREM', QEXP, id)
  place = place or redis.call('ZSCORE', QUEUE, id)
  if not place then return end
  redis.call('ZREM', QUEUE, id)
  local rank, seq = math.floor(tonumber(place) / RANK), tonumber(place) % RANK
  queued_delta(rank, -1)
  local acct, weight = account_of(id)
  local queue = account_queue(rank, acct)
  redis.call('ZREM', queue, id)
  local old = member(seq, acct)
  if redis.call('ZSCORE', account_index(rank), old) then reindex(rank, acct, weight, old) end
end

-- How many grants likely go before a newcomer `id` of tier `rank`: the waiters of the same
-- or a better tier; in a `fair` tier the better tiers' waiters, its own account's waiters in
-- the tier (`own`, when the caller counted them), and for each other waiting account as
-- many as its turn takes ((own + 1) / weight each, as if the others weighed 1 and held as
-- many slots), at most the whole tier.
local function turn_of(id, rank, fair, own)
  local ahead = waiting_upto(rank)
  if not fair then return ahead end
  local better = ahead - (waiting_counts()[rank + 1] or 0)
  local acct, weight = account_of(id)
  own = own or redis.call('ZCARD', account_queue(rank, acct))
  local others = redis.call('ZCARD', account_index(rank)) - math.min(own, 1)
  return better + math.min(ahead - better, own + math.ceil((own + 1) / weight) * others)
end

-- The oldest waiter of the account with the best claim in tier `rank` (fewest leases held
-- relative to its weight, then the oldest waiter), as {id, place, rank, acct, entry: its
-- account's member of the index, next: the sequence of the account's next waiter or nil};
-- nil when no account waits there. An entry left stale (its account's queue empty) is
-- dropped on the way.
local function fair_head(rank)
  local index = account_index(rank)
  for _ = 1, 64 do
    local best = redis.call('ZRANGE', index, '0', '0')[1]
    if not best then return nil end
    local acct = string.sub(best, 17)
    local two = redis.call('ZRANGE', account_queue(rank, acct), '0', '1', 'WITHSCORES')
    if two[1] then
      return {id = two[1], rank = rank, acct = acct, entry = best, next = two[4]}
    end
    redis.call('ZREM', index, best)
  end
  return nil
end

-- The fair head `h` (`fair_head`) leaves the queue, its account holding `held` now (by its
-- tier's measure): its account's next waiter, if any, stands for the account in the index.
local function take_head(h, held)
  redis.call('ZREM', QEXP, h.id)
  redis.call('ZREM', QUEUE, h.id)
  queued_delta(h.rank, -1)
  redis.call('ZREM', account_queue(h.rank, h.acct), h.id)
  local index = account_index(h.rank)
  redis.call('ZREM', index, h.entry)
  if h.next then
    local _, weight = account_of(h.id)
    redis.call('ZADD', index, (held or 0) / weight, member(h.next, h.acct))
  end
end
