-- Shared by the model scripts (prepended once when they are registered): the key names,
-- then the functions a script's common case calls (its `-- @needs` line names them: each
-- `-- @fn` block below), then at the script's `-- @rest` line (or before the script when it
-- has none) all the others. Lua makes each local function anew on every call (about 150 ns
-- with its upvalues), so the common case makes only those it calls (routing/scripts.py).
-- KEYS[1] is the model's `leases`; its other keys are named after it (the same hash tag
-- {model}, so every script touches one Cluster slot). A key passed in KEYS costs a script
-- about 230 ns, a name made here about 100 ns, and only the names a path uses are made.
-- leases   ZSET "lease_id url" -> expiry (ms, Redis TIME): each names its endpoint (an id
--          or a URL holds no space), so nothing else records where a lease runs
-- queue    ZSET waiter_id -> rank * 1e15 + sequence (rank 0 priority, 1 default, 2 flex)
-- ep_of    HASH lease_id -> endpoint url, of leases whose member is the id alone (`split`):
--          slots the pump granted to waiters, until their replica claims them (`hold`), so
--          that a grant whose wake-up was lost is found in O(1) (`find_lease`)
-- eps      HASH endpoint url -> "max_concurrency penalty", of the endpoints in rotation: the
--          endpoint index, written by a replica at start, on reload and when health changes
--          (index.lua), never passed per call
-- free     ZSET endpoint url -> load / max_concurrency + penalty, of the endpoints in rotation
--          that have room: the least loaded is its head (one ZRANGE, whatever the number of
--          endpoints), kept by `rescore` at every change of a load
-- ep_load  HASH endpoint url -> leases held on it; and the field `~s`, present while Redis
--          holds this model's state (a replica that has seen it before and finds it gone
--          knows Redis restarted empty or failed over): '0', or '00' while a rebuild window
--          may be open (`rebuild`); and `~f`: 2 x the slots freed so far (releases and
--          expiries, for Retry-After), plus 1 while someone may wait in `queue` (set when
--          it turns empty or not, mended by every sweep): so a release counts its free and
--          learns whether to pump in one HINCRBY, and the acquire reads it with the loads;
--          and `~v`: the version of the endpoint index (index.lua), absent until it is written.
-- seq      STRING queue sequence
-- qexp     ZSET waiter_id -> liveness expiry (ms): its replica's sweep extends it, so the
--          waiters of a dead replica leave the queue within the waiter TTL
-- rebuild  STRING, present for a short while after Redis lost this model's state: no slot
--          is granted until every replica has written back its own
-- wake     the channel granted waiters are woken on
-- Fair share's keys (prelude's rest) are named the same way. What each script costs, in O()
-- of the endpoints (n), queue (w) and waiting accounts (a): docs/architecture.md.
local LEASES = KEYS[1]
local BASE = string.sub(LEASES, 1, -7)
local QUEUE, EP_OF, EP_LOAD = BASE .. 'queue', BASE .. 'ep_of', BASE .. 'ep_load'
local QEXP = BASE .. 'qexp'
local EPS, FREE = BASE .. 'eps', BASE .. 'free'
-- On one Redis, acquire and release may be given an account's key after the model's leases
-- (on a Cluster they are given every key of the model, routing/admission/slots.py
-- `declare_all`, and never an account's: it lives on another node).
local ACCOUNT = KEYS[#KEYS == 2 and 2 or 0]
-- The state marker's value when no rebuild window can be open: the common case's test.
local STEADY = '0'
-- A tier's ceiling at the sum of the endpoints' sizes, which `pick` holds each endpoint to:
-- not checked (routing/slots.py `UNBOUND`).
local UNBOUND = '-'
local RANK = 1e15
-- `free` was found empty and nothing was added since (`pick`, `rescore`): a later pick in the
-- same script answers without a call (a full model's acquire picks twice).
local full = false
-- Read once per script (a script runs at one instant): Redis's TIME, and the queue's length
-- (kept by `enqueue` and `unqueue`, the only writers of the queue).
local clock = nil
local queue_len = nil
local function queue_size()
  if queue_len == nil then queue_len = redis.call('ZCARD', QUEUE) end
  return queue_len
end

-- @fn now_ms
local function now_ms()
  clock = clock or redis.call('TIME')
  local t = clock
  local micros = t[2] + 0
  return t[1] * 1000 + (micros - micros % 1000) / 1000  -- (cheaper than math.floor)
end

-- @fn score
-- A whole number as text, for the bounds of a range (ZCOUNT '(' .. n). A number handed to
-- Redis as it is costs less than this (string.format is about 0.75 usec, redis.call's own
-- '%.17g' less, and exact for whole numbers below 2^53: times in ms, queue places).
local function score(n)
  return string.format('%.0f', n)
end

-- @fn rescore
-- Endpoint `ep` holds `load` leases now: its place in `free` follows (in while it is in
-- rotation with room, scored by its load relative to its size plus the worker's own load
-- signal, the penalty >= 0; out while full). One HGET and one write. Equal loads take
-- turns: a score carries when it was set (at most 1e-6, the time within 100 s: far below
-- one lease's weight), so the endpoint touched longest ago comes first among them.
-- `spec`: its entry in `eps`, when the caller read it. Returns its size (nil: not in rotation).
local touched = nil
local function rescore(ep, load, spec)
  spec = spec or redis.call('HGET', EPS, ep)
  if not spec then return nil end
  local at = string.find(spec, ' ', 1, true)
  local size = tonumber(string.sub(spec, 1, at - 1))
  if load < size then
    if not touched then
      clock = clock or redis.call('TIME')
      local t = clock
      touched = ((t[1] % 100) * 1e6 + t[2]) * 1e-14
    end
    redis.call('ZADD', FREE, load / size + tonumber(string.sub(spec, at + 1)) + touched, ep)
    full = false
  else
    redis.call('ZREM', FREE, ep)
  end
  return size
end

-- @fn take_slot
-- One more lease counted on `ep` if it has room by its own count (`ep_load`, which every
-- release of the gateway keeps, where `free` is this one's: during a rolling update a
-- replica of the release before fills endpoints without telling `free`): true; else
-- nothing is taken, `ep` leaves `free`, false. As many calls as counting the lease.
local function take_slot(ep)
  local spec = redis.call('HGET', EPS, ep)
  if not spec then
    redis.call('ZREM', FREE, ep)
    return false
  end
  local load = redis.call('HINCRBY', EP_LOAD, ep, '1')
  if load <= rescore(ep, load, spec) then return true end
  rescore(ep, redis.call('HINCRBY', EP_LOAD, ep, '-1'), spec)
  return false
end

-- @fn drop_lease
-- Forget `id`'s lease on `ep`; 1 if it was there. Its first write (ZREM) is not `denyoom`:
-- see `expire`.
local function drop_lease(id, ep)
  if redis.call('ZREM', LEASES, id .. ' ' .. ep) == 0 then return 0 end
  rescore(ep, redis.call('HINCRBY', EP_LOAD, ep, '-1'))
  return 1
end

-- @fn pick
-- The endpoint to take: the first with room of the `k` preferred in `src` from index `at`
-- (prefix-cache affinity, a few at most), else the least loaded with room (the head of
-- `free`); nil when every endpoint in rotation is full. At most two calls, whatever the
-- number of endpoints.
local function pick(src, at, k)
  if full then return nil end
  if k > 0 then
    local found = redis.call('ZMSCORE', FREE, unpack(src, at, at + k - 1))
    for i = 1, k do
      if found[i] then return src[at + i - 1] end
    end
  end
  local ep = redis.call('ZRANGE', FREE, 0, 0)[1]
  full = not ep
  return ep
end

-- @fn grant
-- A lease of `id` on `ep` until `expiry`, counted whatever the load (a lease written back:
-- its request runs there).
local function grant(id, ep, expiry)
  redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
  rescore(ep, redis.call('HINCRBY', EP_LOAD, ep, '1'))
end

-- @fn seat
-- A new lease of `id` until `expiry` on the endpoint `pick` finds with room (from `src` at
-- `at`, `k` preferred): the endpoint, or nil when none has room (an endpoint `free` had
-- wrong is dropped from it on the way: `take_slot`).
local function seat(id, expiry, src, at, k)
  for _ = 1, 8 do
    local ep = pick(src, at, k)
    if not ep then return nil end
    -- The lease first: a script that fails there (a key of another type) wrote nothing.
    local m = id .. ' ' .. ep
    redis.call('ZADD', LEASES, expiry, m)
    if take_slot(ep) then return ep end
    redis.call('ZREM', LEASES, m)
  end
  return nil
end

-- @fn take_account
-- An account's own limit across replicas: `key` is gw:acct:{account}, a ZSET lease_id ->
-- expiry. Takes an entry for `id` until `expiry` unless the account holds `limit` live ones
-- (entries of replicas that died are reclaimed only when it looks full); true when taken.
-- The key lives `ttl` ms more, and goes with its last entry: accounts of replicas that died
-- leave nothing behind. (`expiry` and `ttl` as text: a number costs a conversion per call.)
local function take_account(key, id, limit, now, expiry, ttl)
  if redis.call('ZCARD', key) >= limit then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    if redis.call('ZCARD', key) >= limit then return false end
  end
  redis.call('ZADD', key, expiry, id)
  redis.call('PEXPIRE', key, ttl)
  return true
end

-- @rest

local SEQ, REBUILD, CHANNEL = BASE .. 'seq', BASE .. 'rebuild', BASE .. 'wake'

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
local HELD = BASE .. 'held'
local function account_queue(rank, acct) return BASE .. 'fq:' .. rank .. ':' .. acct end
local function account_index(rank) return BASE .. 'fi:' .. rank end
local function member(seq, acct) return string.format('%016d', seq) .. acct end

-- The account and weight an id carries ('' and 1 for an id without them).
local function account_of(id)
  local w, a = string.match(id, '~([^~]*)~([^~]*)$')
  return a or '', tonumber(w) or 1
end

-- A member of `leases`: its lease id and endpoint. A member written before members named
-- their endpoint is the id alone, its endpoint in `ep_of`.
local function split(m)
  local at = string.find(m, ' ', 1, true)
  if at then return string.sub(m, 1, at - 1), string.sub(m, at + 1) end
  return m, redis.call('HGET', EP_OF, m)
end

-- The lease `id` holds, for ids whose endpoint the caller does not know: its endpoint, its
-- member of `leases` and its expiry; nil when none. A waiter's grant not yet claimed is
-- found in O(1) (`ep_of`); a lease whose acquire went unanswered (its member names its
-- endpoint) only by trying every endpoint that ever held a lease, O(endpoints), a rare case
-- (a call in doubt), left out when `scan` is false.
local function find_lease(id, scan)
  local ep = redis.call('HGET', EP_OF, id)
  if ep then
    local expiry = redis.call('ZSCORE', LEASES, id)
    if expiry then return ep, id, expiry end
  end
  if scan == false then return nil end
  local urls, members = {}, {}
  for _, field in ipairs(redis.call('HKEYS', EP_LOAD)) do
    if string.sub(field, 1, 1) ~= '~' then
      urls[#urls + 1] = field
      members[#members + 1] = id .. ' ' .. field
    end
  end
  for from = 1, #members, 1000 do
    local upto = math.min(from + 999, #members)
    local found = redis.call('ZMSCORE', LEASES, unpack(members, from, upto))
    for i = 1, upto - from + 1 do
      if found[i] then return urls[from + i - 1], members[from + i - 1], found[i] end
    end
  end
  return nil
end

-- Forget a lease `find_lease` found (its member `m` on `ep`); 1 if it was there.
local function drop_found(m, ep)
  if redis.call('ZREM', LEASES, m) == 0 then return 0 end
  if not string.find(m, ' ', 1, true) then redis.call('HDEL', EP_OF, m) end
  rescore(ep, redis.call('HINCRBY', EP_LOAD, ep, '-1'))
  return 1
end

-- Keep a lease `find_lease` found until `expiry`. A waiter's grant is claimed so: its member
-- names its endpoint from then on, as every other lease's does.
local function keep_found(id, ep, m, expiry)
  if m ~= id then
    redis.call('ZADD', LEASES, 'XX', expiry, m)
    return
  end
  redis.call('ZREM', LEASES, id)
  redis.call('HDEL', EP_OF, id)
  redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
end

-- A lease of `id`'s account was granted (1) or given back (-1): counted while someone waits.
local function count(id, delta)
  if queue_size() == 0 then return end
  local acct = account_of(id)
  if redis.call('HINCRBY', HELD, acct, delta) <= 0 then redis.call('HDEL', HELD, acct) end
end

-- Whether someone may wait, in the low bit of `~f` (its other bits count frees): set to `on`,
-- the field made if missing (without it the common cases take the long way). Returns `~f`.
local function mark_waiting(on)
  local marks = tonumber(redis.call('HGET', EP_LOAD, '~f') or '-1')
  if marks < 0 then
    marks = on and 1 or 0
    redis.call('HSET', EP_LOAD, '~f', marks)
  elseif (marks % 2 == 1) ~= on then
    marks = redis.call('HINCRBY', EP_LOAD, '~f', on and 1 or -1)
  end
  return marks
end

-- Count every account's leases afresh (O(leases), once each time the queue stops being
-- empty; leases granted meanwhile were not counted).
local function recount()
  redis.call('DEL', HELD)
  local per = {}
  for _, m in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
    local acct = account_of(string.match(m, '^[^ ]+'))
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
-- account that waits nowhere). `ranks`: how many tiers; `skip`: a tier whose entry is right
-- already (reindexed after the change).
local function reweigh(id, ranks, skip)
  local acct, weight = account_of(id)
  for rank = 0, ranks - 1 do
    local head = rank ~= skip and
      redis.call('ZRANGE', account_queue(rank, acct), 0, 0, 'WITHSCORES') or {}
    if head[1] then reindex(rank, acct, weight, member(tonumber(head[2]), acct)) end
  end
end

-- Queue `id` at `seq` in tier `rank`: in the model's queue, its account's and the index.
local function enqueue(id, rank, seq)
  if queue_size() == 0 then
    recount()
    mark_waiting(true)
  end
  queue_len = queue_len + redis.call('ZADD', QUEUE, rank * RANK + seq, id)
  local acct, weight = account_of(id)
  local queue = account_queue(rank, acct)
  local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  redis.call('ZADD', queue, seq, id)
  if head[1] == nil or seq < tonumber(head[2]) then
    reindex(rank, acct, weight, head[1] and member(tonumber(head[2]), acct))
  end
end

-- Take an id out of the queue (a no-op for an id never queued, but a write that is not
-- `denyoom`: see `expire`), its account's queue and, if it was the oldest, the index.
-- `place`: its score in the queue, when the caller read it.
local function unqueue(id, place)
  redis.call('ZREM', QEXP, id)
  place = place or redis.call('ZSCORE', QUEUE, id)
  if not place then return end
  queue_len = queue_size() - 1  -- read before the ZREM, if not known yet
  redis.call('ZREM', QUEUE, id)
  if queue_len == 0 then
    redis.call('DEL', HELD)
    mark_waiting(false)
  end
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
local function turn_of(id, rank, fair, ahead)
  ahead = ahead or redis.call('ZCOUNT', QUEUE, '-inf', '(' .. score((rank + 1) * RANK))
  if not fair then return ahead end
  local better = redis.call('ZCOUNT', QUEUE, '-inf', '(' .. score(rank * RANK))
  local acct, weight = account_of(id)
  local own = redis.call('ZCARD', account_queue(rank, acct))
  local others = redis.call('ZCARD', account_index(rank)) - math.min(own, 1)
  return better + math.min(ahead - better, own + math.ceil((own + 1) / weight) * others)
end

-- The oldest waiter of the account with the best claim in tier `rank` (fewest leases held
-- relative to its weight, then the oldest waiter), and its place in the queue; or nil. Entries left stale (a waiter
-- Redis no longer queues) are mended on the way.
local function fair_head(rank)
  local index = account_index(rank)
  for _ = 1, 64 do
    local best = redis.call('ZRANGE', index, 0, 0)[1]
    if not best then return nil end
    local acct = string.sub(best, 17)
    local head = redis.call('ZRANGE', account_queue(rank, acct), 0, 0)[1]
    local place = head and redis.call('ZSCORE', QUEUE, head)
    if place then return head, place end
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
  local upto = now
  if waiting ~= false then late = redis.call('ZRANGEBYSCORE', QEXP, '-inf', upto) end
  redis.call('ZREMRANGEBYSCORE', QEXP, '-inf', upto)
  for _, id in ipairs(late) do unqueue(id) end
  local gone = redis.call('ZRANGEBYSCORE', LEASES, '-inf', upto)
  for i, m in ipairs(gone) do
    local id, ep = split(m)
    redis.call('ZREM', LEASES, m)
    if ep then rescore(ep, redis.call('HINCRBY', EP_LOAD, ep, '-1')) end
    if id == m then redis.call('HDEL', EP_OF, id) end
    count(id, -1)
    gone[i] = id
  end
  if #gone > 0 and queue_size() > 0 then
    for _, id in ipairs(gone) do reweigh(id, ranks or RANKS) end
  end
  if #gone > 0 then redis.call('HINCRBY', EP_LOAD, '~f', 2 * #gone) end
end

-- The waiter of the best tier that may take a slot now and its place, or nil: in a `fair`
-- tier the oldest
-- of the account with the best claim (`fair_head`), else the tier's oldest. A tier whose own
-- ceiling is reached does not hold up the tiers behind it (a priority ceiling set below
-- default's must not stall the default queue).
local function eligible_head(inflight, ceilings, fair)
  for rank = 0, #ceilings - 1 do
    if inflight < ceilings[rank + 1] then
      -- A tier's waiters queued by scripts without account queues go after the others.
      local head = fair[rank + 1] and {fair_head(rank)} or {}
      if not head[1] then
        head = redis.call('ZRANGEBYSCORE', QUEUE, score(rank * RANK),
          '(' .. score((rank + 1) * RANK), 'WITHSCORES', 'LIMIT', 0, 1)
      end
      if head[1] then return head[1], head[2] end
    end
  end
  return nil
end

-- Redis lost this model's state (restart, failover) and replicas are writing back what they
-- hold: until all had a sweep to do so, free-looking slots may be held by requests running.
-- Read once per script: only `open_window` sets it during one (and Redis's clock, so its
-- expiry, stands still while a script runs).
local rebuild_open = nil
local function rebuilding()
  if rebuild_open == nil then rebuild_open = redis.call('EXISTS', REBUILD) == 1 end
  return rebuild_open
end

-- Open the rebuild window for `ms`: the state marker says so too (the common case then
-- checks `rebuild`; the sweep sets it back once the window is over).
local function open_window(ms)
  redis.call('SET', REBUILD, '1', 'PX', ms)
  rebuild_open = true
  redis.call('HSET', EP_LOAD, '~s', '00')
end

-- Whether Redis lost this model's state: the marker is gone. A replica that has seen it
-- before (`known`) then pauses grants for `rebuild_ms` (every replica's next sweep writes
-- back what it holds within it); one that never saw it (a first start) just sets it. The
-- queue's sequence restarts from Redis TIME, after any place a waiter held before.
-- `present`: whether the marker is there, when the caller read it already.
local function lost(now, known, rebuild_ms, present)
  if present == nil then present = redis.call('HGET', EP_LOAD, '~s') ~= false end
  if present then return false end
  redis.call('HSET', EP_LOAD, '~s', STEADY, '~f', '0')
  if tonumber(redis.call('GET', SEQ) or '0') < now then redis.call('SET', SEQ, now) end
  if known == '1' and tonumber(rebuild_ms) > 0 then open_window(rebuild_ms) end
  return true
end

-- Hand free slots to waiters, best tier first, while there is room; wake each by message.
-- A granted waiter's lease lasts only `claim` ms until its replica claims it (a grant to a
-- replica that died goes back quickly); its member is its id alone, its endpoint in `ep_of`
-- (`find_lease`). ceilings[rank + 1] = capacity x max_utilization; fair[rank + 1]: whether
-- that tier shares between accounts.
local function pump(now, claim, ceilings, fair)
  if queue_size() == 0 or rebuilding() then return 0 end
  local granted = 0
  while true do
    -- An endpoint with room first: one read when the model is full (the common end of a
    -- pump under load), where finding the head takes several.
    local ep = pick(nil, 0, 0)
    if not ep then break end
    local id, place = eligible_head(redis.call('ZCARD', LEASES), ceilings, fair)
    if not id then break end
    if take_slot(ep) then  -- else `free` had it wrong: it left, the next is tried
      -- Counted first: leaving the queue reindexes its tier's entry (the head is its
      -- account's oldest there) with the lease already counted; the other tiers follow.
      count(id, 1)
      local rank = math.floor(tonumber(place) / RANK)
      unqueue(id, place)
      redis.call('ZADD', LEASES, now + claim, id)
      redis.call('HSET', EP_OF, id, ep)
      reweigh(id, #ceilings, rank)
      redis.call('PUBLISH', CHANNEL, id .. ' ' .. ep)
      granted = granted + 1
    end
  end
  return granted
end

-- A lease this replica holds: kept for `ttl` ms more (a waiter's grant claimed so, see
-- `keep_found`), or written back if Redis lost it (restart, failover). Returns 1 when it
-- had to be written back.
local function hold(id, ep, expiry)
  unqueue(id)
  if redis.call('ZSCORE', LEASES, id .. ' ' .. ep) then
    redis.call('ZADD', LEASES, 'XX', expiry, id .. ' ' .. ep)
    return 0
  end
  local granted = redis.call('HGET', EP_OF, id)
  if granted and redis.call('ZSCORE', LEASES, id) then
    keep_found(id, granted, id, expiry)
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
-- script about 170 ns whether read or not), as words (`words`) from index `at`:
-- "claim_ms n ceiling.. fair", the tiers' ceilings best first, then one letter per tier,
-- best first ('a' shares between accounts, 'f' first come first served). The endpoints are
-- not in it: they are in the index (`eps`, `free`). Returns claim_ms, the ceilings and
-- whether each tier is fair.
local function parse_spec(t, at)
  local a = (at or 1) - 1
  local n = tonumber(t[a + 2])
  local ceilings, fair = {}, {}
  for i = 1, n do
    ceilings[i] = tonumber(t[a + 2 + i]) or math.huge  -- UNBOUND
    fair[i] = string.sub(t[a + 3 + n], i, i) == 'a'
  end
  return tonumber(t[a + 1]), ceilings, fair
end
