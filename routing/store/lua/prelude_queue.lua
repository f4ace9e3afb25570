-- The prelude's rest, first part: an id's parts, the queue's places and counts per tier,
-- and finding a lease by its id.
-- Fair share. An id ends in "~weight~account" (routing/slots.py `make_lease_id`), so every
-- script knows a lease's or waiter's account and weight from its id alone (a dead replica's
-- lease too). Its keys are named after the queue's (the same hash tag, so the same node):
-- `held`   HASH account -> leases of the model it holds, and "t:" .. account -> the tokens
--          they reserve: counted only while someone waits (the common case pays nothing),
--          counted afresh from the leases when the queue stops being empty (`enqueue`);
-- per tier, each waiting account's queue (ZSET waiter -> sequence), and the index of the
-- waiting accounts (ZSET "sequence of its oldest waiter, 16 digits" .. account -> held /
-- weight, held in requests or in tokens by the tier's mode: the lowest score first, ties to
-- the oldest waiter, which the member's order gives).
-- A tier's rank as text (Lua turns a number into text with sprintf: about 0.5 usec each).
local RANK_TEXT = {[0] = '0', [1] = '1', [2] = '2'}
local function rank_text(rank) return RANK_TEXT[rank] or string.format('%d', rank) end
local function account_queue(rank, acct) return BASE .. 'fq:' .. rank_text(rank) .. ':' .. acct end
local function account_index(rank) return BASE .. 'fi:' .. rank_text(rank) end
-- The index's member for an account whose oldest waiter has sequence `seq` (a whole number,
-- or its digits as Redis wrote them: a score read back, no sprintf needed then).
local function member(seq, acct)
  if type(seq) == 'string' and not string.find(seq, '[^0-9]') then
    return string.rep('0', 16 - #seq) .. seq .. acct
  end
  return string.format('%016d', seq) .. acct
end
-- A waiter's place in the queue, rank x RANK + seq, as text: the sequence's digits after
-- the rank's (a sequence stays below RANK: it starts from Redis's clock in ms).
local function place_of(rank, seq)
  if rank == 0 then return seq end
  return rank_text(rank) .. string.rep('0', 15 - #seq) .. seq
end

-- The account and weight an id carries ('' and 1 for an id without them).
local function account_of(id)
  local w, a = string.match(id, '~([^~]*)~([^~]*)$')
  return a or '', tonumber(w) or 1
end

-- The waiters queued per tier, best first (`~w<rank>` in `ep_load`): read once per script
-- (`set_waits` where the caller read them with its own HMGET) and kept as the script changes
-- the queue (`queued_delta`), so that the queue's length, a tier's, and the waiters ahead of
-- a newcomer cost no call. Every sweep sets them from the queue itself (`mend_waits`): a
-- replica of the release before queues without counting (a rolling update).
local function set_waits(values)
  waits = {}
  for r = 1, ranks do waits[r] = tonumber(values[r]) or 0 end
end

local function waiting_counts()
  if not waits then
    local fields = {}
    for r = 1, ranks do fields[r] = '~w' .. rank_text(r - 1) end
    set_waits(redis.call('HMGET', EP_LOAD, unpack(fields)))
  end
  return waits
end

local function queue_size()
  local n = 0
  for _, c in ipairs(waiting_counts()) do n = n + c end
  return n
end

-- Waiters of tier `rank` and the better ones.
local function waiting_upto(rank)
  local w, n = waiting_counts(), 0
  for r = 1, rank + 1 do n = n + (w[r] or 0) end
  return n
end

-- The model's leases (in flight), read once per script and kept as it grants.
local function inflight()
  if not leases_n then leases_n = redis.call('ZCARD', LEASES) end
  return leases_n
end

-- A member of `leases`: its lease id and endpoint. A member written before members named
-- their endpoint (or a grant of the release before this one) is the id alone, its endpoint
-- in `ep_of`.
local function split(m)
  local at = string.find(m, ' ', 1, true)
  if at then return string.sub(m, 1, at - 1), string.sub(m, at + 1) end
  return m, redis.call('HGET', EP_OF, m)
end

-- The scores of `members` in the sorted set `key` (false where absent), in one call per
-- 1,000 (Lua's unpack takes a few thousand values at most).
local function scores_of(key, members)
  local all = {}
  for from = 1, #members, 1000 do
    local upto = math.min(from + 999, #members)
    local found = redis.call('ZMSCORE', key, unpack(members, from, upto))
    for j = from, upto do all[j] = found[j - from + 1] end
  end
  return all
end

-- Set the scores of members `key` holds already, from `flat` (score, member, ...), in one
-- call per 1,000.
local function set_scores(key, flat)
  for from = 1, #flat, 2000 do
    redis.call('ZADD', key, 'XX', unpack(flat, from, math.min(from + 1999, #flat)))
  end
end

-- The lease `id` holds, for ids whose endpoint the caller does not know: its endpoint, its
-- member of `leases` and its expiry; nil when none. A waiter's grant not yet claimed is
-- found in O(1) (`ep_of`); a lease whose acquire went unanswered (its member names its
-- endpoint) only by trying every endpoint that ever held a lease, O(endpoints), a rare case
-- (a call in doubt), left out when `scan` is false.
-- The endpoints `ep_load` counts (its fields but its own marks), read once per call.
local function endpoint_urls()
  if not ep_urls then
    ep_urls = {}
    for _, field in ipairs(redis.call('HKEYS', EP_LOAD)) do
      if string.sub(field, 1, 1) ~= '~' then ep_urls[#ep_urls + 1] = field end
    end
  end
  return ep_urls
end

local function find_lease(id, scan)
  local ep = redis.call('HGET', EP_OF, id)
  if ep then
    local m = id .. ' ' .. ep
    local expiry = redis.call('ZSCORE', LEASES, m)
    if expiry then return ep, m, expiry end
    expiry = redis.call('ZSCORE', LEASES, id)  -- a grant of the release before: the id alone
    if expiry then return ep, id, expiry end
  end
  if scan == false then return nil end
  local urls, members = endpoint_urls(), {}
  for i, url in ipairs(urls) do members[i] = id .. ' ' .. url end
  local found = scores_of(LEASES, members)
  for i = 1, #members do
    if found[i] then return urls[i], members[i], found[i] end
  end
  return nil
end

-- Forget `id`'s lease that `find_lease` found (its member `m` on `ep`); 1 if it was there.
local function drop_found(id, m, ep)
  if redis.call('ZREM', LEASES, m) == 0 then return 0 end
  redis.call('HDEL', EP_OF, id)
  give_slot(id, ep)
  return 1
end

-- Keep a lease `find_lease` found until `expiry`: a waiter's grant is claimed so (its entry
-- in `ep_of` goes; a grant of the release before is written as every other lease is).
-- Its first write (HDEL) is not `denyoom`: see `expire`.
local function keep_found(id, ep, m, expiry)
  redis.call('HDEL', EP_OF, id)
  if m ~= id then
    redis.call('ZADD', LEASES, 'XX', expiry, m)
    return
  end
  redis.call('ZREM', LEASES, id)
  redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
end
