-- Give slots back (or take waiters out of the queue) and hand freed slots on.
-- KEYS: the model's leases (prelude), and on one Redis the account whose entries for these
-- ids go too (prelude: ACCOUNT). ARGV: 1 the spec (prelude: `parse_spec`), 2 n, then n
-- pairs: a lease or waiter id, and the lease's endpoint ('' when not known: a waiter, an
-- id whose acquire went unanswered).
-- Used for the end of a request, a waiter whose caller left, and any id whose state in
-- Redis is in doubt (idempotent: an id Redis does not hold changes nothing).
-- Returns how many waiters were granted.
-- @needs rescore drop_lease
local freed, unsure = {}, {}
for i = 3, 2 + 2 * tonumber(ARGV[2]), 2 do
  local id, ep = ARGV[i], ARGV[i + 1]
  -- A lease is never queued at the same time: a waiter leaves the queue when granted.
  if ep ~= '' and drop_lease(id, ep) == 1 then freed[#freed + 1] = id else unsure[#unsure + 1] = id end
  if ACCOUNT then redis.call('ZREM', ACCOUNT, id) end
end
-- The frees counted, and whether anyone may wait, in one call (prelude: `~f`; text for the
-- common one: a number costs a conversion). Nobody waits: nothing to hand on, and expired
-- leases wait for the sweep.
if #freed > 0 then
  local marks = redis.call('HINCRBY', EP_LOAD, '~f', #freed == 1 and '2' or 2 * #freed)
  if #unsure == 0 and marks % 2 == 0 then return 0 end
end
-- @rest
local now = now_ms()
local claim, ceilings, fair = parse_spec(words(ARGV[1]))
-- An id not found where the caller said (or it did not know): a waiter still queued, else
-- a lease elsewhere (granted while it waited, or moved; prelude: `find_lease`).
local found = 0
for _, id in ipairs(unsure) do
  local ep, m
  if not redis.call('ZSCORE', QUEUE, id) then ep, m = find_lease(id) end
  if ep and drop_found(m, ep) == 1 then
    freed[#freed + 1] = id
    found = found + 1
  else
    unqueue(id)
  end
end
if found > 0 then redis.call('HINCRBY', EP_LOAD, '~f', 2 * found) end
if queue_size() == 0 then return 0 end
-- The accounts that gave slots back have a better claim now (fair share).
for _, id in ipairs(freed) do
  count(id, -1)
  reweigh(id, #ceilings)
end
expire(now, nil, #ceilings)
return pump(now, claim, ceilings, fair)
