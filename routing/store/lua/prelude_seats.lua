-- The endpoint index and the choice of an endpoint (`rescore`, `take_slot`, `take_any`,
-- `seat`), a lease's tokens and slot (`tokens_of`, `fits`, `give_slot`, `drop_lease`,
-- `grant`), an account's own limit (`take_account`): each an `-- @fn` block, the
-- functions a script's common case may call (prelude_names.lua says how they are used).
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
