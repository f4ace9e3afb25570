-- Take a slot for a request, or queue it, or say why not. One round trip.
-- KEYS: 1 the model's leases (prelude), 2 on one Redis the account's key (see below).
-- ARGV: 1 lease_id, 2 ttl_ms, 3 rank, 4 its tier's ceiling (or UNBOUND: prelude), 5 the
--       share of an endpoint's token budget its tier may fill, 6 'v' when its lease may be
--       preempted until it starts (a flex request, where a tier may preempt: prelude
--       `pre`), else '-', 7 k, 8.. the k endpoints prefix-cache affinity prefers, in order
--       (prelude: `seat`; k small and fixed, 0 without affinity: the endpoints themselves
--       are in Redis, not passed), then in one argument "may_wait (0|1) max_queue
--       waiter_ttl_ms known rebuild_ms max_turn at_head (0|1) may_preempt (0|1)" and the
--       spec (prelude: `parse_spec`) (waiter_ttl_ms: how long its replica's waiters stay
--       queued without its next sweep, prelude `live`; known: this replica has seen the
--       model's state before, 0|1, see `lost`; max_turn: the most grants it may wait behind
--       to meet its deadline, '-' for none; at_head: a preempted request queued again
--       before its tier's waiters); with ACCOUNT, then the account's limit. The id
--       carries its account, weight and the tokens it reserves (prelude: `account_of`,
--       `tokens_of`).
-- The common case reads only the first seven and the preferred: an argument costs a script
-- about 170 ns whether it reads it or not, so the others come packed.
-- Returns, when granted, the endpoint (a string: a table reply costs Redis about 1.5 usec
-- more); else {status, '', inflight, ahead, seq, rebuild, turn}: status 2 queued (seq = its
-- place in its tier), 0 busy, -1 full (ahead = waiters of the same or a better tier), -2 the
-- account is at its limit, -3 Redis holds no endpoint index for the model (a first start,
-- or Redis lost it: nothing was taken, the replica writes it with index.lua and asks
-- again), -4 its wait would pass its deadline (more than max_turn grants ahead: it is not
-- queued); turn = the grants likely to go first (prelude: `turn_of`); rebuild = ms left of
-- the rebuild window when that is why it is busy, else 0; inflight = the model's leases (0
-- when queued: not read then). Queued, its seq is negated when a
-- lease was preempted for it (prelude: `preempt`).
-- @needs now_ms take_account tokens_of parse_ep rescore fits take_slot take_any seat
local id, ttl, k = ARGV[1], ARGV[2], tonumber(ARGV[7])
local tokens, frac = tokens_of(id), tonumber(ARGV[5])
local now = now_ms()
-- The expiry of what is taken, as text once (a number would be converted by each call).
local expiry = (now + ttl) .. ''
-- The first write, not `denyoom` (prelude: `expire`): a no-op for an id never queued (one
-- queued before leaves its place below, in the rest: the queue is not empty then). Left
-- out where Redis lets the script itself run at maxmemory (routing/scripts.py `ALLOW_OOM`).
local requeued = nil
requeued = redis.call('ZREM', QEXP, id)  -- @oom-guard
-- The state marker, `~f`, the index's version and the waiters per tier (prelude: `ep_load`),
-- in one call.
local loads = redis.call('HMGET', EP_LOAD, '~s', '~f', '~v', unpack(WAIT_FIELDS))
if not loads[3] then return {-3, '', 0, 0, 0, 0, 0} end
-- On one Redis a walk's first try takes the account's own slot here too: ACCOUNT is its
-- key, the last argument its limit (on a Cluster, account.lua does it in the same round
-- trip). At the limit nothing is taken: status -2.
if ACCOUNT then
  local limit = tonumber(ARGV[9 + k])
  if not take_account(ACCOUNT, id, limit, now, expiry, ttl) then return {-2, '', 0, 0, 0, 0} end
end
-- The common case costs a few reads: the model's state known, no rebuild window, nobody
-- waiting, room for the tier. Then there is nothing to pump, and leases that expired
-- meanwhile (a replica died) only make the model look fuller until the sweep reclaims them.
if loads[1] == STEADY and loads[2] and loads[2] % 2 == 0
    and (ARGV[4] == UNBOUND or redis.call('ZCARD', LEASES) < tonumber(ARGV[4])) then
  local ep = seat(id, expiry, ARGV, 8, k, tokens, frac)
  if ep then
    if ARGV[6] == 'v' then redis.call('ZADD', PRE, now, id .. ' ' .. ep) end
    return ep
  end
end
-- @rest

local rank = tonumber(ARGV[3])
local t, claim, ceilings, fair, fracs = spec_of(ARGV[8 + k], 9)
local may_wait, max_queue, waiter_ttl, known, rebuild_ms = t[1], t[2], t[3], t[4], t[5]
local max_turn, at_head, may_preempt = tonumber(t[6]), t[7] == '1', t[8] == '1'  -- ('-': nil)
if #ceilings == RANKS then set_waits({unpack(loads, 4, 3 + RANKS)}) end
steady(loads[1])
counted = loads[2] ~= false and loads[2] % 2 == 1  -- (prelude: `counting`)
-- An id queued before (an acquire sent again) leaves its old place first where the guard
-- above found it. (A library runs without the guard: such an id is queued again at the
-- back, its places updated where they are, the count unchanged, and its account's entry in
-- the index set right at the account's next grant. The gateway never sends one.)
if requeued == 1 then unqueue(id) end
lost(now, known, rebuild_ms, loads[1] ~= false)
local claim_until = (now + claim) .. ''
pump(claim_until, ceilings, fair, fracs)
-- After the pump no waiter that could take a slot is left: a newcomer with room for its
-- tier jumps nobody who could have gone first (in a fair tier neither: no account waits).
local function take()
  if (ceilings[rank + 1] == math.huge or inflight() < ceilings[rank + 1])
      and not rebuilding() then
    return seat(id, expiry, ARGV, 8, k, tokens, frac)
  end
end
local ep = take()
-- Whether a waiter of this tier or a better one may take a slot now: its tier waits and its
-- ceiling lets it (no call beyond the leases' count, read once).
local function ahead_may_go()
  local w = waiting_counts()
  for r = 1, rank + 1 do
    if (w[r] or 0) > 0 and (ceilings[r] == math.huge or inflight() < ceilings[r]) then
      return true
    end
  end
  return false
end
-- The model may look full: leases whose replica died must not make it so. Where a waiter of
-- this tier or a better one may take a slot, this one queues behind them anyway (the sweeps
-- reclaim within a second and hand the slots to the queue): one call less per queued
-- request. Waiters held back by their tier's ceiling (a worse tier's, or a better tier's
-- set below this one's) do not hold this one back; what the reclaim frees goes to the queue
-- first (one it lets under its ceiling), as every slot does, then to this one.
if not ep and not ahead_may_go() then
  reclaim(now)
  pump(claim_until, ceilings, fair, fracs)
  ep = take()
end
if ep then
  count(id, 1)
  if ARGV[6] == 'v' then redis.call('ZADD', PRE, now, id .. ' ' .. ep) end
  return ep
end
local own = redis.call('ZCARD', account_queue(rank, (account_of(id))))
local ahead = waiting_upto(rank)
local turn = turn_of(id, rank, fair[rank + 1], own)
-- While Redis is being rebuilt nobody queues either: the account counts this request was
-- checked against may not be written back yet, and a waiter would keep its entry. (A
-- refusal tells the leases in flight; a waiter is not told, one call less.)
if rebuilding() then
  return {0, '', inflight(), ahead, 0, math.max(1, redis.call('PTTL', REBUILD)), turn}
end
if may_wait ~= '1' then return {0, '', inflight(), ahead, 0, 0, turn} end
-- The bound counts the waiters a newcomer would wait behind, so flex waiters can never make
-- a priority request `queue_full` (the whole queue holds at most 3 x max_queue).
if ahead >= tonumber(max_queue) then return {-1, '', inflight(), ahead, 0, 0, turn} end
-- A tier that may preempt takes a slot from a flex request that has not started, rather
-- than waiting for one to end; one whose wait would pass its deadline is not queued.
local preempted = may_preempt and preempt(now, rank) == 1
if not preempted and max_turn and turn > max_turn then
  return {-4, '', inflight(), ahead, 0, 0, turn}
end
local seq = at_head and head_seq(rank) or tostring(redis.call('INCR', SEQ))
enqueue(id, rank, seq, not at_head and own or nil)
live(id, now, tonumber(waiter_ttl))
return {2, '', 0, ahead, preempted and -tonumber(seq) or tonumber(seq), 0, turn}
