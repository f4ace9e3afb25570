-- Each replica's sweep of one model (about every second):
--  1. reclaim expired leases and dead replicas' waiters;
--  2. keep this replica's leases (written back if Redis lost them);
--  3. say this replica is alive (its waiters stay queued while it is: `alive`, prelude
--     `bury`); when it names its waiters (not at every sweep: when Redis may have lost them
--     or their wake-ups), re-queue those Redis lost (original place), and claim those
--     granted meanwhile (a wake-up message may have been lost);
--  4. hand free slots on; 5. report the model's state.
-- KEYS: 1 the model's leases (prelude). ARGV: 1 ttl_ms, 2 the score this replica's last
--       sweep of the model answered wrote in `alive` ('' when not known), 3 the spec
--       (prelude: `parse_spec`),
--       then n and n lease_id/endpoint pairs, then m and m waiter_id/score pairs, then
--       rebuild_ms: how long grants pause once this sweep had to write anything back,
--       known (0|1: this replica has seen the model's state before), then r and r endpoint
--       urls whose place in `free` is set again from their count (a few per sweep, in turn:
--       mends what a replica of an older release changed without `free`, a rolling update),
--       then p and p ids that may hold a lease this replica does not hold yet (its acquires
--       not answered yet, its waiters woken), then this replica's id and how long its
--       waiters stay queued without its next sweep (the waiter TTL; both absent from a
--       replica of an older release, whose sweeps name every waiter), then, when this
--       sweep names every waiter after Redis lost writes, the number this replica's ids
--       have reached and s and s ids of its walks under way (prelude `purge`).
-- Returns {{inflight, queued per tier (best first), freed so far, the endpoint index's
--          version or ''}, written-back lease ids, one entry per waiter: its granted
--          endpoint or '', the leases of this replica among inflight (its leases, kept or
--          written back, its waiters' grants and the pending ids' leases: read in the same
--          instant as inflight, for the local outage shares), the waiters queued again at
--          their place as lost (neither queued nor granted: a grant they had is gone),
--          {1 (2: Redis lost writes since its last sweep) if this replica's waiters are to be named now (Redis did not know it alive, or
--          not by its last sweep's word: it restarted empty, failed over and lost writes, or
--          the replica was away past the waiter TTL and its waiters left the queue), Redis's
--          clock in ms (for the wake-ups' times; its `alive` score is that + the waiter
--          TTL)}, how many leases and waiters `purge` took out}.
-- Its cost grows with what this replica holds (its waiters only when it names them) and
-- with the endpoints only while nothing is held at all (the loads' mend, below), never with
-- the queue of other replicas but once for each replica that died (prelude `bury`, at most
-- 5,000 entries a call).
-- The waiters per tier set from the queue itself (prelude: `waiting_counts`), where they
-- differ: whatever slipped (a replica of the release before queues without counting). A
-- queue found waiting while fair share's counts are not kept has them made afresh (the
-- pump below counts from there on).
local function mend_waits(waiting)
  local real, now_total, changed = {}, 0, false
  local w = waiting_counts()
  for rank = 0, ranks - 1 do
    real[rank + 1] = waiting and
      redis.call('ZCOUNT', QUEUE, rank * RANK, '(' .. score((rank + 1) * RANK)) or 0
    now_total = now_total + real[rank + 1]
    changed = changed or real[rank + 1] ~= w[rank + 1]
  end
  if now_total > 0 and not counting() then
    recount()
    mark_waiting(true)
  end
  if not changed then return end
  local flat = {}
  for rank = 0, ranks - 1 do
    flat[#flat + 1] = '~w' .. rank
    flat[#flat + 1] = real[rank + 1]
  end
  redis.call('HSET', EP_LOAD, unpack(flat))
  set_waits(real)
end

-- The fair tiers' indexes scored again by what each waiting account holds, by its tier's
-- measure now, when the tiers' ways of sharing (`fair`, from the spec) differ from those the
-- indexes were scored by (`~m` in `ep_load`): after a reload that changes `fairness`, an
-- entry scored by leases would be compared with others' tokens (or the other way round)
-- until its account's next grant or release. O(waiting accounts), once per change.
local function rescore_fair(fair)
  local letters = ''
  for i = 1, #fair do letters = letters .. (fair[i] or 'f') end
  local was = redis.call('HGET', EP_LOAD, '~m')
  if was == letters then return end
  redis.call('HSET', EP_LOAD, '~m', letters)
  for rank = 0, #fair - 1 do
    local index = account_index(rank)
    for _, entry in ipairs(fair[rank + 1] and redis.call('ZRANGE', index, '0', '-1') or {}) do
      local acct = string.sub(entry, 17)
      local head = redis.call('ZRANGE', account_queue(rank, acct), '0', '0')[1]
      if head then
        local _, weight = account_of(head)
        redis.call('ZADD', index, held_of(acct, rank) / weight, entry)
      else
        redis.call('ZREM', index, entry)
      end
    end
  end
end

-- Fair share's counts are kept while someone waits and for KEEP_MS after a sweep first found
-- the queue empty (`~e` in `ep_load`: when): a model at its capacity, whose queue comes and
-- goes, would otherwise count every lease afresh (O(leases), `recount`) each time a request
-- queues behind an empty queue. Once the queue stayed empty that long the counts go, and the
-- common cases skip them again. Returns `~f`.
local KEEP_MS = 10000
-- The most lookups (pending ids x endpoints) a sweep makes for its pending ids: about 2 ms.
local PENDING_CHECKS = 5000
local function settle_counting(now)
  if queue_size() > 0 then
    if not counting() then recount() end
    redis.call('HDEL', EP_LOAD, '~e')
    return mark_waiting(true)
  end
  local found = redis.call('HMGET', EP_LOAD, '~f', '~e')
  local marks, since = tonumber(found[1]), tonumber(found[2])
  if marks and marks % 2 == 1 then
    if not since then
      redis.call('HSET', EP_LOAD, '~e', now)
      return marks
    end
    if now - since < KEEP_MS then return marks end
  end
  redis.call('DEL', HELD)
  if since then redis.call('HDEL', EP_LOAD, '~e') end
  return mark_waiting(false)
end

local now = now_ms()
-- Idle (nobody queued), a sweep skips the queue's work: late waiters, pump, counts per tier.
local waiting = redis.call('ZCARD', QUEUE) > 0
local _, claim, ceilings, fair, fracs = spec_of(ARGV[3])
local pending = 4 + 2 * tonumber(ARGV[4]) + 1
pending = pending + 2 * tonumber(ARGV[pending]) + 3
pending = pending + (tonumber(ARGV[pending]) or 0) + 1
local me = ARGV[pending + (tonumber(ARGV[pending]) or 0) + 1]
local was = me and redis.call('ZSCORE', ALIVE, me)
expire(now, waiting, me)
local marker = redis.call('HGET', EP_LOAD, '~s')
local ttl = tonumber(ARGV[1])
-- How long this replica's waiters stay queued without its next sweep (the waiter TTL; from
-- a caller that names no replica, at least 3 s: `live` gives its waiters their own entry).
local wttl = tonumber(ARGV[pending + (tonumber(ARGV[pending]) or 0) + 2]) or 3000
local at = 4
local tail = at + 2 * tonumber(ARGV[at]) + 1
tail = tail + 2 * tonumber(ARGV[tail]) + 1
local fresh = lost(now, ARGV[tail + 1], ARGV[tail], marker ~= false)
if not fresh and marker ~= STEADY and not rebuilding() then
  -- The rebuild window is over: the common case may skip the check again.
  redis.call('HSET', EP_LOAD, '~s', STEADY)
end
-- Its leases: those Redis holds kept in one call per 1,000 (ZMSCORE, then ZADD XX), not four
-- calls each; one Redis lost is written back (prelude: `hold`).
local restored, keep = {}, {}
local n = tonumber(ARGV[at])
local members = {}
for i = at + 1, at + 2 * n, 2 do members[#members + 1] = ARGV[i] .. ' ' .. ARGV[i + 1] end
local until_ms = (now + ttl) .. ''
local present = scores_of(LEASES, members)
for j = 1, #members do
  if present[j] then
    keep[#keep + 1] = until_ms
    keep[#keep + 1] = members[j]
  else
    local i = at + 2 * j - 1
    if hold(ARGV[i], ARGV[i + 1], now + ttl) == 1 then restored[#restored + 1] = ARGV[i] end
  end
end
set_scores(LEASES, keep)
at = at + 2 * n + 1
local granted, requeued = {}, {}
-- This replica's leases: every one it sent is held now (kept, or written back).
local mine = n
-- Once Redis lost the model's state a waiter not queued holds no lease either: it is not
-- looked for among the endpoints (prelude: `find_lease`), it goes back to its place. A lease
-- written back without that (it expired: this replica's sweeps were late; a failover lost
-- it) says nothing of a waiter's grant, found only so (no `ep_of` for it).
local scan = not fresh
-- Its waiters named: their places read in one call per 1,000 (ZMSCORE); one not queued was
-- granted meanwhile (its lease is kept and its endpoint said) or lost (queued again at its
-- place). One still queued lives by this replica (`alive`, prelude `live`); an entry of its
-- own in `qexp` (an id that names no replica) is kept for the waiter TTL (ZADD XX: no
-- entry, nothing written).
local ids, alive_ids = {}, {}
for i = at + 1, at + 2 * tonumber(ARGV[at]), 2 do ids[#ids + 1] = ARGV[i] end
local places = scores_of(QUEUE, ids)
local alive = (now + wttl) .. ''
for j, id in ipairs(ids) do
  local place = places[j]
  local ep, m
  if not place then ep, m = find_lease(id, scan) end
  if ep then
    keep_found(id, ep, m, now + ttl)
    granted[j] = ep
    mine = mine + 1
  elseif place then
    granted[j] = ''
    alive_ids[#alive_ids + 1] = alive
    alive_ids[#alive_ids + 1] = id
  else
    -- Lost: back at its place.
    granted[j] = ''
    requeued[#requeued + 1] = id
    place = ARGV[at + 2 * j]
    local rank, seq = math.floor(tonumber(place) / RANK), tonumber(place) % RANK
    enqueue(id, rank, score(seq))
    live(id, now, wttl)
    if tonumber(redis.call('GET', SEQ) or '0') < seq then redis.call('SET', SEQ, seq) end
  end
end
set_scores(QEXP, alive_ids)
-- After Redis lost writes (the caller names all it holds, and the number its ids have
-- reached): what it does not hold goes (prelude `purge`), before the pump hands slots on.
local purged, tail_at = 0, pending + (tonumber(ARGV[pending]) or 0) + 3
local upto = tonumber(ARGV[tail_at])
if me and upto then
  local kept, spare = {}, {}
  for _, m in ipairs(members) do kept[m] = true end
  for _, id in ipairs(ids) do spare[id] = true end
  for i = tail_at + 2, tail_at + 1 + tonumber(ARGV[tail_at + 1]) do spare[ARGV[i]] = true end
  purged = purge(me, upto, kept, spare)
end
if #restored + #requeued > 0 and not rebuilding() then
  open_window(ARGV[tail])
end
wide()
-- A few endpoints' place in `free` set again from their own count, before the pump: a slot
-- it missed (a rolling update's older replica freed it) goes to a waiter now.
local recheck = tail + 2
for i = recheck + 1, recheck + (tonumber(ARGV[recheck]) or 0) do
  rescore(ARGV[i], tonumber(redis.call('HGET', EP_LOAD, ARGV[i])) or 0)
end
-- Its ids that may hold a lease it does not hold yet: those that do are its own too, looked
-- for on every endpoint in one call per 1,000 lookups; not at all past PENDING_CHECKS (a
-- busy replica's thousands of acquires in flight times a thousand endpoints blocked Redis
-- for seconds): its local share then counts fewer than it holds, never more.
local np = tonumber(ARGV[pending]) or 0
if np > 0 and np * #endpoint_urls() <= PENDING_CHECKS then
  local owners, candidates = {}, {}
  for i = pending + 1, pending + np do
    for _, url in ipairs(endpoint_urls()) do
      owners[#owners + 1], candidates[#candidates + 1] = ARGV[i], ARGV[i] .. ' ' .. url
    end
  end
  local found, seen = scores_of(LEASES, candidates), {}
  for j = 1, #candidates do
    if found[j] and not seen[owners[j]] then
      seen[owners[j]] = true
      mine = mine + 1
    end
  end
end
waiting = waiting or #requeued > 0
mend_waits(waiting)
if waiting then
  rescore_fair(fair)
  pump((now + claim) .. '', ceilings, fair, fracs)
end
-- Preemption's marks that outlived their use: a lease that has not started within two lease
-- TTLs is no longer offered (its request is slow, or ended without saying), a preempted
-- one whose holder never gave it back (it died) is reclaimed by its expiry anyway.
if roles and string.find(table.concat(roles), 'v', 1, true) then
  redis.call('ZREMRANGEBYSCORE', PRE, '-inf', now - 2 * ttl)
  redis.call('ZREMRANGEBYSCORE', DOOMED, '-inf', now - ttl)
end
-- The counting bit the common cases read, set right (an enqueue sets it; a sweep mends
-- whatever slipped, and clears it once the queue stayed empty: `settle_counting`).
local marks = settle_counting(now)
local state = {redis.call('ZCARD', LEASES)}
-- Nothing held: every endpoint's load is 0. Mends a count that could not be taken back (a
-- lease an older release reclaimed without knowing its endpoint, during a rolling update).
-- Nor is any grant in `ep_of`: an older release's grant to a waiter of this one stays there
-- (only its claim deleted it, and this release does not claim) after its lease ended.
if state[1] == 0 then
  redis.call('DEL', EP_OF)
  local tokens = redis.call('DEL', EP_TOK) == 1  -- none reserved either
  local fields = redis.call('HGETALL', EP_LOAD)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 1) ~= '~' and (tokens or fields[i + 1] ~= '0') then
      redis.call('HSET', EP_LOAD, fields[i], '0')
      rescore(fields[i], 0, nil, 0)
    end
  end
end
for rank = 0, #ceilings - 1 do state[#state + 1] = waiting_counts()[rank + 1] end
state[#state + 1] = (marks - marks % 2) / 2  -- slots freed so far
state[#state + 1] = redis.call('HGET', EP_LOAD, '~v') or ''
-- This replica alive: its waiters stay queued for the waiter TTL from now. Not known alive (`was`), or not
-- by the score its last sweep wrote: its waiters are to be named now (Redis lost them, or
-- `bury` took them out). Redis applies writes in order, and a replica of it copies them
-- so: that score there means nothing written before that sweep was lost, so only the
-- waiters queued since (which the replica names once, at its next sweep) may be.
local name = 0
if me then
  redis.call('ZADD', ALIVE, now + wttl, me)
  redis.call('HDEL', GONE, me)
  -- Kept while anyone waits (prelude `waited_for`); a while after the queue emptied, gone.
  if queue_size() > 0 then
    waited_for()
  else
    redis.call('PEXPIRE', ALIVE, 10 * wttl)
  end
  local last = tonumber(ARGV[2])
  if last and was and tonumber(was) ~= last and not fresh then
    name = 2  -- (writes since that sweep were lost: what they took back may be here again)
  elseif not was or tonumber(was) < now or fresh then
    name = 1
  end
end
return {state, restored, granted, mine, requeued, {name, now}, purged}
