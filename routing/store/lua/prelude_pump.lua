-- Handing slots on: the queue's eligible head, the rebuild window after Redis lost state,
-- grants and their wake-ups, preemption.
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
