-- What replicas that died (or stopped past the TTL) held: leases reclaimed, waiters
-- buried, what Redis holds that a replica no longer does purged, waiters' liveness.
-- A lease or waiter whose replica let it go (it died, or stopped past the TTL) takes its
-- entry in its account's count (`gw:acct:{<tag>}`, its id's last word) with it, on one
-- Redis: the entries are kept less often than the leases and outlive them, up to a third of
-- the TTL (routing/admission/accountkeeps.py), and a limited account would be refused for a
-- request no one runs till then. (On a Cluster the key is on another node; there every
-- account is kept at every round, its entries as long-lived as the leases.)
local function drop_entry(id)
  if not ENTRIES then return end
  local tag = account_of(id)
  if tag ~= '' then redis.call('ZREM', ACCOUNT_PREFIX .. tag .. '}', id) end
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

-- Reclaim leases whose holder stopped refreshing them (their replica died): one call when
-- there are none.
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
