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
-- ep_of    HASH lease_id -> endpoint url, of the slots granted to waiters by a release
--          before this one until their replica claimed them: read (`find_lease`), never
--          written now (a sweep that finds no lease at all drops what is left). A grant is
--          found from its member "id endpoint" like every lease; from its id alone (a
--          wake-up lost, a cancel that crossed it) only by trying every endpoint, a rare
--          case. (An older release still wrote a grant's member as the id
--          alone: `split` reads it.)
-- eps      HASH endpoint url -> "max_concurrency penalty", or "max_concurrency penalty
--          budget" for one that holds its requests' reserved tokens to a budget (`parse_ep`),
--          of the endpoints in rotation: the endpoint index, written by a replica at start,
--          on reload and when health changes (index.lua), never passed per call
-- free     ZSET endpoint url -> load / max_concurrency (or its tokens / budget, the larger)
--          + penalty, of the endpoints in rotation that have room: the least loaded is its
--          head (one ZRANGE, whatever the number of endpoints), kept by `rescore` at every
--          change of a load
-- ep_tok   HASH endpoint url -> tokens its leases reserve (the sum of `tokens_of` their ids,
--          kept for every lease that carries a reservation, whatever its endpoint's budget)
-- ep_load  HASH endpoint url -> leases held on it; and the field `~s`, present while Redis
--          holds this model's state (a replica that has seen it before and finds it gone
--          knows Redis restarted empty or failed over): '0', or '00' while a rebuild window
--          may be open (`rebuild`); and `~f`: 2 x the slots freed so far (releases and
--          expiries, for Retry-After), plus 1 while someone may wait in `queue` (set when
--          it turns empty or not, mended by every sweep): so a release counts its free and
--          learns whether to pump in one HINCRBY, and the acquire reads it with the loads;
--          `~v`: the version of the endpoint index (index.lua), absent until it is written;
--          and `~w0` `~w1` `~w2`: the waiters queued per tier (`waiting_counts`), which
--          every change of the queue keeps and every sweep sets from the queue itself;
--          `~m`: the tiers' ways of sharing the fair indexes were last scored by (sweep.lua)
-- seq      STRING queue sequence
-- qexp     ZSET waiter_id -> liveness expiry (ms), of the waiters of a release before this
--          one (its sweeps extend it, so they leave the queue within its TTL once their
--          replica died); this release's waiters live by their replica (`alive`, `live`)
-- alive    ZSET replica -> when the liveness its last sweep of the model gave its waiters
--          ends (`bury`); gone: HASH replica -> how far the look for a dead one's waiters
--          has reached
-- rebuild  STRING, present for a short while after Redis lost this model's state: no slot
--          is granted until every replica has written back its own
-- wake     the channel granted waiters are woken on ("id endpoint"), and the holders of
--          preempted leases told ("!id endpoint")
-- pre      ZSET "lease_id url" -> when granted (ms), of the leases of a tier that may be
--          preempted (flex) whose request has not sent its first byte yet (start.lua takes
--          it out then): what a newcomer of a tier that may preempt takes a slot from
-- doomed   ZSET lease_id -> when preempted (ms): leases whose holder was told to give them
--          back (it does, after cutting its request at the worker short)
-- Fair share's keys (prelude's rest) are named the same way. What each script costs, in O()
-- of the endpoints (n), queue (w) and waiting accounts (a): docs/architecture.md.
-- The state marker's value when no rebuild window can be open: the common case's test.
local STEADY = '0'
-- A tier's ceiling at the sum of the endpoints' sizes, which `pick` holds each endpoint to:
-- not checked (routing/slots.py `UNBOUND`).
local UNBOUND = '-'
local RANK = 1e15
-- A member of `free` that is no endpoint, always there (scored +inf: last, after every
-- endpoint with room), and a field of `ep_load` and `eps` likewise: longer than the 64
-- bytes Redis keeps in a flat list (a listpack, searched from end to end: by default up to
-- 128 entries), so those keys are a skip list and hash tables whatever the number of
-- endpoints, and `free` never goes when the model is full. On 64 endpoints the flat lists
-- cost an admission 35-38 us of Redis CPU where 1 or 1,000 endpoints cost 21-25
-- (bench/fleet.py). Written with the index (index.lua) and by the sweeps; `wide`. In `eps` it
-- reads as an endpoint of size 0 ('0 0'): a replica of a release before it, which takes
-- `free`'s head for an endpoint, finds it full there, drops it from `free` (the next sweep
-- puts it back) and takes none (an entry it could not read failed its script midway, a
-- lease on it written, whose reclaim failed every script of this release that ran it).
-- (A literal: a library's load may not call `string`.)
local WIDE = '~----------------------------------------------------------------'
local RANKS = 3  -- tiers (tiers/policy.py), for callers without the spec
-- Everything below is per call, set by `bind` before a script's own code runs: the keys'
-- names, and what a call reads once (a call runs at one instant). The scripts run as one
-- library of Redis Functions where Redis has them (loaded once: routing/store/scripts.py),
-- else each as a script that binds its own KEYS first.
local LEASES, BASE, QUEUE, EP_OF, EP_LOAD, EP_TOK, QEXP, EPS, FREE, ACCOUNT, PRE, DOOMED
local SEQ, REBUILD, CHANNEL, HELD, ALIVE, GONE, ENTRIES
-- `full`: `free` was found empty and nothing was added since (`pick`, `rescore`): a later
-- pick in the same call answers without a call (a full model's acquire picks twice).
-- `clock`: Redis's TIME. `waits`: the waiters per tier (prelude's rest: `waiting_counts`).
-- `leases_n`: the model's leases (`inflight`). `touched`: `rescore`'s tie-break.
-- `rebuild_open`: whether a rebuild window is open (`rebuilding`). `ranks`: how many tiers,
-- RANKS or as many as the caller's spec names (`parse_spec`). `modes`: each tier's fair
-- share by the spec ('a' accounts' requests, 't' their tokens, false first come first
-- served; nil: not known, requests). `roles`: each tier's part in preemption by the spec
-- ('p' may preempt, 'v' may be preempted, '-' neither; nil: not known, none).
-- `counted`: whether fair share's counts are kept now (the low bit of `~f`, `counting`).
-- `roomy`: `free` is known to hold an endpoint (`has_room`), `free_head`: which is first
-- (`take_any`); both forgotten at each write to `free` (`rescore`, `take_slot`).
local full, clock, waits, leases_n, touched, rebuild_open, ranks, modes, roles, counted
local roomy, free_head
-- `ep_urls`: the endpoints `ep_load` counts, read once per call where a lease is looked for
-- on every endpoint (`endpoint_urls`).
local ep_urls

-- The names are made again only when the model changes: a library of Redis Functions keeps
-- them between calls (about 0.8 usec a call), a script makes them on every call.
local function bind(keys)
  if keys[1] ~= LEASES then
    LEASES = keys[1]
    BASE = string.sub(LEASES, 1, -7)
    QUEUE, EP_OF, EP_LOAD = BASE .. 'queue', BASE .. 'ep_of', BASE .. 'ep_load'
    EP_TOK = BASE .. 'ep_tok'
    PRE, DOOMED = BASE .. 'pre', BASE .. 'doomed'
    QEXP = BASE .. 'qexp'
    EPS, FREE = BASE .. 'eps', BASE .. 'free'
    SEQ, REBUILD, CHANNEL = BASE .. 'seq', BASE .. 'rebuild', BASE .. 'wake'
    HELD, ALIVE, GONE = BASE .. 'held', BASE .. 'alive', BASE .. 'gone'
  end
  -- On one Redis, acquire and release may be given an account's key after the model's
  -- leases (on a Cluster they are given every key of the model, routing/admission/slots.py
  -- `declare_all`, and never an account's: it lives on another node).
  ACCOUNT = keys[#keys == 2 and 2 or 0]
  -- One Redis (given the leases alone, or an account's key too): every key is on this node,
  -- so a dead replica's lease or waiter that leaves takes its account's entry (`drop_entry`).
  ENTRIES = #keys <= 2
  full, clock, waits, leases_n, touched, rebuild_open, ranks = false, nil, nil, nil, nil, nil, RANKS
  modes, roles, counted = nil, nil, nil
  roomy, free_head, ep_urls = nil, nil, nil
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

-- @fn tokens_of
-- The tokens a lease or waiter reserves, from its id: "prefix~tokens~weight~account"
-- (routing/admission/slots.py `make_lease_id`); 0 for an id without them ("prefix~weight~
-- account"). Three plain finds, where a pattern match costs more.
local function tokens_of(id)
  local a = string.find(id, '~', 1, true)
  local b = a and string.find(id, '~', a + 1, true)
  if not b or not string.find(id, '~', b + 1, true) then return 0 end
  return tonumber(string.sub(id, a + 1, b - 1)) or 0
end

-- @fn parse_ep
-- An endpoint's entry in `eps`: its size, penalty, token budget (nil: none) and whole
-- budget (what it holds before adaptation shrinks it: the most a request alone there may
-- reserve).
local function parse_ep(spec)
  local size, penalty, budget, whole = string.match(spec, '^(%S+) (%S+) ?(%S*) ?(%S*)')
  budget = tonumber(budget)
  return tonumber(size), tonumber(penalty), budget, tonumber(whole) or budget
end

-- @fn rescore
-- Endpoint `ep` holds `load` leases now (and `tok` reserved tokens, when the caller knows:
-- else read where its budget needs them): its place in `free` follows, in while it is in
-- rotation with room (below its size and its budget), scored by its load relative to its
-- size (or its tokens relative to its budget, the larger) plus the worker's own load
-- signal, the penalty >= 0; out while full. One HGET and one write. Equal loads take
-- turns: a score carries when it was set (at most 1e-6, the time within 100 s: far below
-- one lease's weight), so the endpoint touched longest ago comes first among them.
-- `spec`: its entry in `eps`, when the caller read it. Returns whether it has room (nil: not
-- in rotation).
local function rescore(ep, load, spec, tok)
  spec = spec or redis.call('HGET', EPS, ep)
  if not spec then return nil end
  local size, penalty, budget = parse_ep(spec)
  local used = load / size
  if budget then
    tok = tok or tonumber(redis.call('HGET', EP_TOK, ep)) or 0
    if tok / budget > used then used = tok / budget end
  end
  if used < 1 then
    if not touched then
      clock = clock or redis.call('TIME')
      local t = clock
      touched = ((t[1] % 100) * 1e6 + t[2]) * 1e-14
    end
    redis.call('ZADD', FREE, used + penalty + touched, ep)
    full, roomy, free_head = false, true, nil
    return true
  end
  redis.call('ZREM', FREE, ep)
  roomy, free_head = nil, nil
  return false
end

-- @fn fits
-- Whether a lease of `t` tokens fits the endpoint's token budget (nil: it has none) at the
-- share `frac` of it (its tier's), `tok` reserved there with it: alone on the endpoint
-- (`tok` == `t`) a request fits its share of the whole budget (a budget that adapts may
-- have shrunk below it); a tier never fills more than its share, flex not even alone.
local function fits(t, tok, budget, whole, frac)
  return not budget or t == 0 or tok <= budget * frac or (tok == t and t <= whole * frac)
end

-- @fn take_slot
-- One more lease counted on `ep`, reserving `t` tokens, if it has room by its own counts
-- (`ep_load`, which every release of the gateway keeps, where `free` is this one's: during
-- a rolling update a replica of the release before fills endpoints without telling `free`)
-- and its budget holds them (at most the share `frac` of it: a tier's ceiling): true; else
-- nothing is taken, false. Its second result: whether `ep` still has room (in `free`) for
-- some other request. As many calls as counting the lease.
local function take_slot(ep, t, frac)
  local spec = redis.call('HGET', EPS, ep)
  if not spec then
    redis.call('ZREM', FREE, ep)
    roomy, free_head = nil, nil
    return false, false
  end
  local size, _, budget, whole = parse_ep(spec)
  local load = redis.call('HINCRBY', EP_LOAD, ep, '1')
  local tok = t > 0 and redis.call('HINCRBY', EP_TOK, ep, t) or nil
  if load <= size and fits(t, tok, budget, whole, frac) then
    rescore(ep, load, spec, tok)
    return true, true
  end
  load = redis.call('HINCRBY', EP_LOAD, ep, '-1')
  if t > 0 then tok = redis.call('HINCRBY', EP_TOK, ep, -t) end
  return false, rescore(ep, load, spec, tok)
end

-- @fn give_slot
-- `id`'s lease on `ep` is gone: its count and its reserved tokens go back there.
local function give_slot(id, ep)
  local load = redis.call('HINCRBY', EP_LOAD, ep, '-1')
  local t = tokens_of(id)
  rescore(ep, load, nil, t > 0 and redis.call('HINCRBY', EP_TOK, ep, -t) or nil)
end

-- @fn drop_lease
-- Forget `id`'s lease on `ep`; 1 if it was there. Its first write (ZREM) is not `denyoom`:
-- see `expire`.
local function drop_lease(id, ep)
  if redis.call('ZREM', LEASES, id .. ' ' .. ep) == 0 then return 0 end
  give_slot(id, ep)
  return 1
end

-- @fn take_any
-- A slot for a request reserving `t` tokens (`frac`: the share of a budget its tier may
-- fill) on the least loaded endpoint that takes it: the head of `free`, or for a request
-- with a reservation the first of the four at its head that holds it; nil when none does.
-- `try(ep)`: takes the slot (as `take_slot`, with the caller's own writes). An endpoint
-- `free` had wrong (full by its own count) leaves it on the way and the next are read;
-- one that only lacks the tokens stays (smaller requests fit), and this one waits.
local function take_any(t, frac, try)
  local few = t > 0 and '3' or '0'
  for _ = 1, 8 do
    if full then return nil end
    local heads
    if few == '0' and free_head then
      heads = {free_head}  -- (`has_room` just read it)
    else
      heads = redis.call('ZRANGE', FREE, '0', few)
    end
    if not heads[1] or heads[1] == WIDE then
      full, roomy, free_head = true, nil, nil
      return nil
    end
    local dropped = false
    for _, ep in ipairs(heads) do
      if ep == WIDE then break end
      local ok, kept
      if try then ok, kept = try(ep) else ok, kept = take_slot(ep, t, frac) end
      if ok then return ep end
      dropped = dropped or not kept
    end
    if not dropped then return nil end
  end
  return nil
end

-- @fn grant
-- A lease of `id` on `ep` until `expiry`, counted whatever the load (a lease written back:
-- its request runs there), with its reserved tokens.
local function grant(id, ep, expiry)
  ep_urls = nil  -- (its count may be a new field of `ep_load`)
  redis.call('ZADD', LEASES, expiry, id .. ' ' .. ep)
  local load = redis.call('HINCRBY', EP_LOAD, ep, '1')
  local t = tokens_of(id)
  rescore(ep, load, nil, t > 0 and redis.call('HINCRBY', EP_TOK, ep, t) or nil)
end

-- @fn seat
-- A new lease of `id` (reserving `t` tokens, at most the share `frac` of a budget) until
-- `expiry`: on the first of the `k` endpoints prefix-cache affinity prefers in `src` from
-- index `at` that has room for it, else on the least loaded that does (`take_any`). The
-- endpoint, or nil when none has. At most two reads to choose, whatever the number of
-- endpoints.
local function seat(id, expiry, src, at, k, t, frac)
  if full then return nil end
  local function try(ep)
    -- The lease first: a script that fails there (a key of another type) wrote nothing.
    local m = id .. ' ' .. ep
    redis.call('ZADD', LEASES, expiry, m)
    local ok, kept = take_slot(ep, t, frac)
    if not ok then redis.call('ZREM', LEASES, m) end
    return ok, kept
  end
  if k > 0 then
    local found = redis.call('ZMSCORE', FREE, unpack(src, at, at + k - 1))
    for i = 1, k do
      if found[i] and try(src[at + i - 1]) then return src[at + i - 1] end
    end
  end
  return take_any(t, frac, try)
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

-- Reclaim leases whose holder stopped refreshing them (their replica died): one call when
-- there are none.
-- A lease or waiter whose replica let it go (it died, or stopped past the TTL) takes its
-- entry in its account's count (`gw:acct:{<tag>}`, its id's last word) with it, on one
-- Redis: the entries are kept less often than the leases and outlive them, up to a third of
-- the TTL (routing/admission/accountkeeps.py), and a limited account would be refused for a
-- request no one runs till then. (On a Cluster the key is on another node; there every
-- account is kept at every round, its entries as long-lived as the leases.)
local function drop_entry(id)
  if not ENTRIES then return end
  local tag = account_of(id)
  if tag ~= '' then redis.call('ZREM', 'gw:acct:{' .. tag .. '}', id) end
end

-- A member of `leases` forgotten: its slot (and tokens) back, its account's count follows.
local function forget_lease(m)
  local id, ep = split(m)
  redis.call('ZREM', LEASES, m)
  if ep then give_slot(id, ep) end
  redis.call('HDEL', EP_OF, id)
  count(id, -1)
  drop_entry(id)
end

local function reclaim(now)
  local gone = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now)
  if #gone == 0 then return end
  leases_n = nil
  for _, m in ipairs(gone) do forget_lease(m) end
  redis.call('HINCRBY', EP_LOAD, '~f', 2 * #gone)
end

-- The number of an id of replica `prefix` ("<replica>-"): "<replica>-<n>~..." gives n; nil
-- for another replica's (one whose id starts with this one's: "r1-2-5~" is not r1's).
local function number_of(id, prefix)
  if string.sub(id, 1, #prefix) ~= prefix then return nil end
  return tonumber(string.match(id, '^(%d+)~', #prefix + 1))
end

-- What Redis holds of replica `me` that it no longer does: after a failover that lost writes
-- the new master still has the grants, waiters and leases the lost window had taken back
-- (a release, a grant, a give-back), and grants them again to no one. The replica's sweep
-- that names all it holds (`kept`: members of its leases; `spare`: ids it holds or may
-- hold in any form, its waiters and its walks under way) says what is really there: every
-- other lease or waiter of its ids numbered up to `upto` (issued before the sweep left: a
-- later one may land first on another connection) goes. O(leases + queue): only after
-- Redis lost writes (routing/admission/keeper.py). Returns how many went.
local function purge(me, upto, kept, spare)
  local prefix, n = me .. '-', 0
  local function ghost(id)
    local k = number_of(id, prefix)
    return k ~= nil and k <= upto and not spare[id]
  end
  for _, m in ipairs(redis.call('ZRANGE', LEASES, '0', '-1')) do
    if not kept[m] and ghost((split(m))) then
      forget_lease(m)
      n = n + 1
    end
  end
  leases_n = nil
  local queued = redis.call('ZRANGE', QUEUE, '0', '-1', 'WITHSCORES')
  for i = 1, #queued, 2 do
    if ghost(queued[i]) then
      unqueue(queued[i], queued[i + 1])
      drop_entry(queued[i])
      n = n + 1
    end
  end
  return n
end

-- The most entries of the queue one call looks through for dead replicas' waiters (`bury`):
-- about 2 ms; a longer queue is looked through over several calls.
local BURY_SCAN = 5000

-- The waiters of replicas whose sweeps stopped leave the queue. `alive`: replica -> when
-- the liveness its last sweep of the model gave its waiters ends (so a waiter costs its
-- replica's sweeps nothing while it waits: `qexp` only backs it up, over several sweeps);
-- `gone`: replica -> the place the look through the queue for its waiters has reached.
-- Rare (a replica died, or was stopped for longer than the waiter TTL): O(queue) once, at
-- most BURY_SCAN a call. A waiter's id starts with its replica's ("<replica>-<n>~").
local function bury(now, waiting, me)
  local dead = redis.call('ZRANGEBYSCORE', ALIVE, '-inf', now)
  local budget = BURY_SCAN
  for _, r in ipairs(dead) do
    if r ~= me and budget > 0 then
      local from = waiting ~= false and redis.call('HGET', GONE, r)
      local found = waiting == false and {} or redis.call('ZRANGEBYSCORE', QUEUE,
        from and '(' .. from or '-inf', '+inf', 'WITHSCORES', 'LIMIT', 0, budget)
      local prefix = r .. '-'
      for i = 1, #found, 2 do
        local id = found[i]
        if string.sub(id, 1, #prefix) == prefix and string.find(id, '^%d+~', #prefix + 1) then
          unqueue(id, found[i + 1])
          drop_entry(id)
        end
      end
      if #found < 2 * budget then
        redis.call('ZREM', ALIVE, r)
        redis.call('HDEL', GONE, r)
      else
        redis.call('HSET', GONE, r, found[#found])
        redis.call('PEXPIRE', GONE, 60000)  -- (a look left by every replica starts again)
      end
      budget = budget - #found / 2
    end
  end
end

-- The replica a waiter's id names ("<replica>-<n>~...", routing/admission/slots.py), or nil.
local function replica_of(id)
  return string.match(id, '^(.-)%-%d+~')
end

-- `alive` lives a day while anyone waits: its entries are how the waiters of replicas that
-- died are found, though every replica be gone a while (a crash loop, a redeploy), and a
-- volatile eviction policy takes keys of a shorter life first. (PEXPIRE only where its
-- life is under half that: a write that changes nothing is not copied to replicas. No
-- PERSIST: the documented ACL user has no such command, docs/redis.md.)
local WAITED_MS = 86400000
local function waited_for()
  if redis.call('PTTL', ALIVE) < WAITED_MS / 2 then redis.call('PEXPIRE', ALIVE, WAITED_MS) end
end

-- A waiter of this release lives by its replica (`bury`), whose sweeps keep it alive in
-- `alive`: no entry of its own, nothing written or renewed per waiter. Where Redis does not
-- know the replica there yet (its first sweep of the model is still to come: a start, a
-- model a reload added, a Redis that lost it), its acquire writes it, so a replica killed
-- before that sweep leaves no waiter behind past `ttl`. A sweep that finds another score
-- than its last one wrote names its waiters (sweep.lua): nothing a loss took goes unseen.
-- An id that names no replica (never this release's) has its own entry in `qexp`, as the
-- release before gave each waiter.
local function live(id, now, ttl)
  local me = replica_of(id)
  if not me then
    redis.call('ZADD', QEXP, now + ttl, id)
  else
    redis.call('ZADD', ALIVE, 'NX', now + ttl, me)
    waited_for()  -- (the last sweep may have found nobody waiting)
  end
end

-- Reclaim leases whose holder stopped refreshing them, and waiters whose replica stopped
-- keeping them alive. Its first write (ZREMRANGEBYSCORE) frees memory and is not `denyoom`:
-- Redis lets a script that has begun writing finish even at maxmemory with noeviction, so
-- admission and release keep working when Redis is full (usage records, whose script
-- writes first with SET, are refused then and wait in the spool). So every model script
-- writes first either here or with another such write (ZREM, HDEL: `drop_lease`,
-- `unqueue`, `keep_found`). The sweep and move run it on every call; an acquire that may
-- find the model full only reclaims leases (`reclaim`); a release reclaims nothing (the
-- sweeps do, within a second).
-- `waiting` false: the caller found the queue empty, so no late waiter needs to leave it.
-- `me`: the replica sweeping, whose own waiters stay (it is alive: it sweeps now).
local function expire(now, waiting, me)
  local late = {}
  if waiting ~= false then late = redis.call('ZRANGEBYSCORE', QEXP, '-inf', now) end
  redis.call('ZREMRANGEBYSCORE', QEXP, '-inf', now)
  for _, id in ipairs(late) do unqueue(id) end
  reclaim(now)
  bury(now, waiting, me)
end

-- The waiter of the best tier that may take a slot now (a `fair_head` record, or {id, place,
-- rank} in a first-come tier), or nil. A tier's ceiling is checked only where it binds
-- (below the endpoints' sum: prelude `UNBOUND`); a tier whose own ceiling is reached does
-- not hold up the tiers behind it (a priority ceiling set below default's must not stall
-- the default queue). Tiers with no waiter cost nothing.
local function eligible_head(ceilings, fair)
  local w = waiting_counts()
  for rank = 0, #ceilings - 1 do
    local ceiling = ceilings[rank + 1]
    if (w[rank + 1] or 0) > 0 and (ceiling == math.huge or inflight() < ceiling) then
      -- A tier's waiters queued by scripts without account queues go after the others.
      local head = fair[rank + 1] and fair_head(rank)
      if not head then
        local found = redis.call('ZRANGEBYSCORE', QUEUE, score(rank * RANK),
          '(' .. score((rank + 1) * RANK), 'WITHSCORES', 'LIMIT', 0, 1)
        if found[1] then head = {id = found[1], place = found[2], rank = rank} end
      end
      if head then return head end
    end
  end
  return nil
end

-- Redis lost this model's state (restart, failover) and replicas are writing back what they
-- hold: until all had a sweep to do so, free-looking slots may be held by requests running.
-- Read once per script: only `open_window` sets it during one (and Redis's clock, so its
-- expiry, stands still while a script runs). A caller that read the state marker tells
-- `steady` what it found: '0' means no window can be open, no call needed.
local function rebuilding()
  if rebuild_open == nil then rebuild_open = redis.call('EXISTS', REBUILD) == 1 end
  return rebuild_open
end

local function steady(marker)
  if marker == STEADY then rebuild_open = false end
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

-- Whether some endpoint in rotation has room (`free` is not empty): one read, none once
-- known in this call (`full`, `roomy`).
local function has_room()
  if full then return false end
  if roomy then return true end
  local head = redis.call('ZRANGE', FREE, '0', '0')[1]
  full = not head or head == WIDE
  if not full then roomy, free_head = true, head end
  return not full
end

-- The waiter `head` (`eligible_head`) takes a slot on `ep` (counted there already, its
-- tokens too): it leaves the queue, its account holds one more, and its replica is woken by
-- message. Its lease ("id endpoint", as every lease) lasts only `claim_until` (ms, as text)
-- until its replica's next sweep keeps it as it keeps every lease (a grant to a replica that
-- died goes back quickly).
local function grant_head(head, ep, claim_until)
  local id = head.id
  if leases_n then leases_n = leases_n + 1 end
  -- Counted first: the head's account holds one more (its entries in the other tiers
  -- follow), then its entry in this tier moves to its next waiter.
  local _, _, held = count(id, 1, head.rank)
  if head.entry then take_head(head, held and held(head.rank)) else unqueue(id, head.place) end
  local m = id .. ' ' .. ep
  redis.call('ZADD', LEASES, claim_until, m)
  if roles and roles[head.rank + 1] == 'v' then redis.call('ZADD', PRE, now_ms(), m) end
  -- Said with when (Redis's clock): its replica trusts it without asking Redis if it reads
  -- it well within the claim time ("@<ms> id endpoint"; a replica of an older release
  -- finds no waiter of that id, and its sweep claims the grant).
  redis.call('PUBLISH', CHANNEL, '@' .. now_ms() .. ' ' .. m)
end

-- A newcomer of tier `rank`, which may preempt, is about to queue: a lease of a tier that
-- may be preempted whose request has sent nothing yet (`pre`: the latest granted first, the
-- least work lost) is taken from its holder for it, unless enough are on their way out
-- already for those waiting ahead of it (`doomed`). The holder is told ("!id endpoint"),
-- cuts its request at the worker short and gives the lease back; its release hands the slot
-- to the best waiter, the newcomer unless someone better waits: so no worker ever runs more
-- than its size, even for a moment. Returns 1 when a lease was taken for it.
local function preempt(now, rank)
  if redis.call('ZCARD', DOOMED) > waiting_upto(rank) then return 0 end
  for _, m in ipairs(redis.call('ZREVRANGE', PRE, '0', '3')) do
    redis.call('ZREM', PRE, m)
    if redis.call('ZSCORE', LEASES, m) then  -- else it ended meanwhile: the next
      redis.call('ZADD', DOOMED, now, string.match(m, '^[^ ]+'))
      redis.call('PUBLISH', CHANNEL, '!' .. m)
      return 1
    end
  end
  return 0
end

-- The sequence that puts a waiter of tier `rank` before every one queued there now (a
-- preempted request requeued at the head of its tier), or nil when none waits there.
local function head_seq(rank)
  local first = redis.call('ZRANGEBYSCORE', QUEUE, score(rank * RANK),
    '(' .. score((rank + 1) * RANK), 'WITHSCORES', 'LIMIT', 0, 1)
  if not first[1] then return nil end
  return score(tonumber(first[2]) % RANK - 1)
end

-- Hand free slots to waiters, best tier first, while there is room; wake each by message.
-- `claim_until`: when a grant goes back unless claimed (ms, as text). ceilings[rank + 1] =
-- capacity x max_utilization; fair[rank + 1]: how that tier shares (`parse_spec`);
-- fracs[rank + 1]: the share of an endpoint's token budget the tier may fill. A head whose
-- reservation fits on no endpoint now waits, and the waiters behind it too: first come
-- first served, as vLLM's own scheduler (a request that could never fit is refused before
-- it queues: context_too_large).
local function pump(claim_until, ceilings, fair, fracs)
  if queue_size() == 0 or rebuilding() then return 0 end
  local granted = 0
  -- An endpoint with room first: one read when the model is full (the common end of a
  -- pump under load), where finding the head takes several.
  while has_room() do
    local head = eligible_head(ceilings, fair)
    if not head then break end
    local ep = take_any(tokens_of(head.id), fracs[head.rank + 1] or 1)
    if not ep then break end
    grant_head(head, ep, claim_until)
    granted = granted + 1
  end
  return granted
end

-- A slot given back by `gone` on `ep`, its load not taken back yet, goes straight to the
-- best waiter when no endpoint has room (`free` is empty, so `ep` holds the only slot the
-- pump could give), `ep` is still in rotation at a size that holds its count, and its
-- budget holds the waiter's tokens in place of `gone`'s: what the pump would do, without
-- taking the load back and counting it again (three reads, where that takes eight calls).
-- Returns whether it did.
local function hand_on(gone, ep, claim_until, ceilings, fair, fracs)
  if rebuilding() or has_room() then return false end
  local spec = redis.call('HGET', EPS, ep)
  if not spec then return false end
  local size, _, budget, whole = parse_ep(spec)
  local load = tonumber(redis.call('HGET', EP_LOAD, ep)) or 0
  if load > size then return false end
  local head = eligible_head(ceilings, fair)
  if not head then return false end
  local t = tokens_of(head.id)
  local delta = t - tokens_of(gone)
  local tok
  if delta ~= 0 then
    tok = redis.call('HINCRBY', EP_TOK, ep, delta)
  elseif budget and t > 0 then
    tok = tonumber(redis.call('HGET', EP_TOK, ep)) or 0
  end
  -- Held to the budget as `take_slot` holds a new lease, also for a waiter smaller than
  -- `gone`: a budget that shrank under its leases may still be short.
  if not fits(t, tok, budget, whole, fracs[head.rank + 1] or 1) then
    if delta ~= 0 then redis.call('HINCRBY', EP_TOK, ep, -delta) end
    return false
  end
  if delta ~= 0 then rescore(ep, load, spec, tok) end
  grant_head(head, ep, claim_until)
  return true
end

-- A lease this replica holds: kept for `ttl` ms more (a waiter's grant claimed so, see
-- `keep_found`), or written back if Redis lost it (restart, failover). Returns 1 when it
-- had to be written back.
local function hold(id, ep, expiry)
  unqueue(id)
  local m = id .. ' ' .. ep
  if redis.call('ZSCORE', LEASES, m) then
    redis.call('ZADD', LEASES, 'XX', expiry, m)
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

-- Each tier's way of sharing from its letters, best first ('a', 't' or false for 'f': as
-- `parse_spec`), set as `modes` too: for the scripts given only these (cancel, move),
-- so that an account's entry they write in a tier's index is by that tier's own measure.
local function fair_modes(letters)
  local fair = {}
  for i = 1, #letters do
    local letter = string.sub(letters, i, i)
    fair[i] = letter ~= 'f' and letter
  end
  modes = fair
  return fair
end

-- What pumping needs, in one argument read only when someone waits (an argument costs a
-- script about 170 ns whether read or not), as words (`words`) from index `at`:
-- "claim_ms n ceiling.. fair frac..", the tiers' ceilings best first, then one letter per
-- tier, best first ('a' shares between accounts by their requests, 't' by their tokens, 'f'
-- first come first served), then each tier's share of an endpoint's token budget, then one
-- letter per tier for preemption ('p' may preempt, 'v' may be preempted, '-' neither). The
-- endpoints are not in it: they are in the index (`eps`, `free`). Returns claim_ms, the
-- ceilings, each tier's way of sharing ('a', 't' or false: `modes` too) and the shares
-- (and sets `roles`).
local function parse_spec(t, at)
  local a = (at or 1) - 1
  local n = tonumber(t[a + 2])
  if n ~= ranks then
    ranks, waits = n, nil
  end
  local ceilings, fair, fracs = {}, {}, {}
  for i = 1, n do
    ceilings[i] = tonumber(t[a + 2 + i]) or math.huge  -- UNBOUND
    local letter = string.sub(t[a + 3 + n], i, i)
    fair[i] = letter ~= 'f' and letter
    fracs[i] = tonumber(t[a + 3 + n + i]) or 1
  end
  modes = fair
  local letters = t[a + 4 + 2 * n] or ''
  roles = {}
  for i = 1, n do roles[i] = string.sub(letters, i, i) end
  return tonumber(t[a + 1]), ceilings, fair, fracs
end

-- The words of a packed argument and its spec parsed (`words`, `parse_spec` from index `at`),
-- kept by the text they came from: a model's spec (and an acquire's packed argument, but for
-- a deadline) is the same from call to call, and a library of Redis Functions keeps them
-- between calls (about 4.5 usec a call; a script parses each time). What is kept is only
-- read. At most SPECS_MAX texts per `at`, all forgotten when that is reached.
local SPECS_MAX = 256
local specs, specs_n = {}, {}

local function spec_of(packed, at)
  at = at or 1
  local kept = specs[at]
  if not kept or specs_n[at] >= SPECS_MAX then
    kept = {}
    specs[at], specs_n[at] = kept, 0
  end
  local c = kept[packed]
  if not c then
    local t = words(packed)
    local claim, ceilings, fair, fracs = parse_spec(t, at)
    kept[packed], specs_n[at] = {t, claim, ceilings, fair, fracs, roles}, specs_n[at] + 1
    return t, claim, ceilings, fair, fracs
  end
  if #c[3] ~= ranks then ranks, waits = #c[3], nil end
  modes, roles = c[4], c[6]
  return c[1], c[2], c[3], c[4], c[5]
end

-- The endpoint keys' long entries (prelude `WIDE`), where missing: a Redis that lost them
-- (restarted empty, an older replica took the one in `free` for an endpoint).
local function wide()
  redis.call('ZADD', FREE, 'NX', '+inf', WIDE)
  redis.call('HSET', EP_LOAD, WIDE, '0')
  redis.call('HSET', EPS, WIDE, '0 0')
end
