-- Give slots back (or take waiters out of the queue) and hand freed slots on.
-- KEYS: the model's leases (prelude), and on one Redis the account whose entries for these
-- ids go too (prelude: ACCOUNT). ARGV: 1 the spec (prelude: `parse_spec`), 2 n, then n
-- pairs: a lease or waiter id, and the lease's endpoint ('' when not known: a waiter, an
-- id whose acquire went unanswered).
-- Used for the end of a request, a waiter whose caller left, and any id whose state in
-- Redis is in doubt (idempotent: an id Redis does not hold changes nothing).
-- Returns how many waiters were granted.
-- @needs tokens_of parse_ep rescore give_slot
local freed, on, unsure = {}, {}, {}
for i = 3, 2 + 2 * tonumber(ARGV[2]), 2 do
  local id, ep = ARGV[i], ARGV[i + 1]
  -- A lease is never queued at the same time: a waiter leaves the queue when granted. The
  -- first write, ZREM, is not `denyoom` (prelude: `expire`).
  if ep ~= '' and redis.call('ZREM', LEASES, id .. ' ' .. ep) == 1 then
    freed[#freed + 1], on[#on + 1] = id, ep
  else
    unsure[#unsure + 1] = id
  end
  if ACCOUNT then redis.call('ZREM', ACCOUNT, id) end
end
-- The frees counted, and whether fair share's counts are kept (someone waits, or did
-- lately), in one call (prelude: `~f`, `counting`; text for the common one: a number costs a
-- conversion). Not kept: nobody waits, the endpoints' loads go back, and there is nothing to
-- hand on (expired leases wait for the sweep). Kept: the rest counts, and while someone
-- waits hands each slot on, on its endpoint when no other has room (prelude: `hand_on`).
local waiting = true
if #freed > 0 then
  local marks = redis.call('HINCRBY', EP_LOAD, '~f', #freed == 1 and '2' or 2 * #freed)
  waiting = marks % 2 == 1
  counted = waiting
  if not waiting then
    for i, ep in ipairs(on) do give_slot(freed[i], ep) end
    if #unsure == 0 then return 0 end
  end
end
-- @rest
local _, claim, ceilings, fair, fracs = spec_of(ARGV[1])
-- The state marker and the waiters per tier, in one call (prelude: `ep_load`).
local fields = {'~s'}
for r = 1, #ceilings do fields[r + 1] = '~w' .. rank_text(r - 1) end
local state = redis.call('HMGET', EP_LOAD, unpack(fields))
steady(state[1])
set_waits({unpack(state, 2)})
local claim_until = (now_ms() + claim) .. ''
-- An id not found where the caller said (or it did not know): a waiter still queued, else
-- a lease elsewhere (granted while it waited, or moved; prelude: `find_lease`).
local found = {}
for _, id in ipairs(unsure) do
  local ep, m
  local place = redis.call('ZSCORE', QUEUE, id)
  if not place then ep, m = find_lease(id) end
  if ep and drop_found(id, m, ep) == 1 then
    found[#found + 1] = id
  else
    unqueue(id, place)  -- (its first write, ZREM, is not `denyoom`: prelude `expire`)
  end
end
if #found > 0 then redis.call('HINCRBY', EP_LOAD, '~f', 2 * #found) end
-- Someone waits (or may, by `~f`): the accounts that gave slots back have a better claim
-- now (fair share), then each slot goes on, or its load back.
for _, id in ipairs(found) do count(id, -1) end
local granted = 0
if waiting then
  for _, id in ipairs(freed) do count(id, -1) end
  for i, ep in ipairs(on) do
    if queue_size() > 0 and hand_on(freed[i], ep, claim_until, ceilings, fair, fracs) then
      granted = granted + 1
    else
      give_slot(freed[i], ep)
    end
  end
end
if queue_size() == 0 then return granted end
-- Leases that expired meanwhile are left to the sweeps (each reclaims within a second).
return granted + pump(claim_until, ceilings, fair, fracs)
